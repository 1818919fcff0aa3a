"""The host thread's torch intra-op threads while the caller computes its loss on the pipeline's output.

Between a training call's forward and its backward every worker is idle and the host thread runs
the caller's code: the loss on the merged output and the loss's backward (for a language model,
a cross-entropy over the whole batch's logits). That phase should use the threads the caller
asked torch for (``torch.set_num_threads``, or torch's default: the cores).

It would not by itself: torch keeps a thread count per thread, and a thread takes the count last
set anywhere in the process when it first runs a parallel operator. The CPU backend's compute
lanes set one thread each when they start, so a host thread that had not run one yet (a
Lightning training loop has not) runs the caller's loss on a single core afterwards.

``CallerThreads`` reads the caller's count when the engine is built, before any lane starts, in
a short-lived thread (reading it in the host thread would fix the host thread's own count there
and then). ``for_caller`` gives the host thread that count from the forward's return to the
backward, ``for_pipeline`` gives back the count it had while the pipeline ran, so the host's
work beside the workers (adding gradients into ``.grad``) and any thread started later run
as before. Thread counts change no result: torch's reductions split the same way whatever the
number of threads.
"""

from __future__ import annotations

import threading

import torch

READ_TIMEOUT_S = 10.0  # reading a thread count takes microseconds; a stuck read leaves the counts alone


def caller_thread_count() -> int | None:
    """The intra-op thread count a thread started now gets (the last ``torch.set_num_threads``, or
    torch's default), read without fixing the calling thread's own; None if the read did not return."""
    found: list[int] = []
    reader = threading.Thread(target=lambda: found.append(torch.get_num_threads()),
                              name="roundpipe-thread-count", daemon=True)
    reader.start()
    reader.join(READ_TIMEOUT_S)
    return found[0] if found else None


class CallerThreads:
    """The host thread's intra-op threads: the caller's between forward and backward (module doc)."""

    def __init__(self, caller: int | None):
        self.caller = caller
        self.pipeline: int | None = None  # the host thread's count while the pipeline ran, once changed

    def for_caller(self) -> None:
        """The forward returns to the caller: give the host thread the caller's thread count."""
        if self.caller is None:
            return
        current = torch.get_num_threads()
        if current != self.caller:
            self.pipeline = current
            torch.set_num_threads(self.caller)

    def for_pipeline(self) -> None:
        """The pipeline's backward starts: give the host thread back the count it had in the forward."""
        if self.pipeline is not None:
            torch.set_num_threads(self.pipeline)
            self.pipeline = None
