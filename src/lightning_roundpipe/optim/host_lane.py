"""A host thread that runs optimizer work in submission order, with completions and trace records."""

from __future__ import annotations

import queue
import threading
from typing import Callable

from ..tracing.records import TraceRecord, TraceRecorder
from ..workers.completions import Completion, TaskLabel


class HostLane:
    """The host thread the overlapped optimizer's layer steps run on, one after another."""
    def __init__(self, trace: TraceRecorder, notifier=None, name: str = "roundpipe-optim"):
        """``notifier``: the worker pool whose lanes wait for these completions (uploads gated on
        a layer's new version), told when each one is set."""
        self.trace = trace
        self._notifier = notifier
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object], label: TaskLabel, traced: bool = True) -> Completion:
        """Run ``fn`` after everything submitted before; ``traced=False``: bookkeeping kept off the timeline."""
        done = Completion(label, self._notifier)
        self._queue.put((fn, done, traced))
        return done

    def has_waiting(self) -> bool:
        """Whether work submitted to this lane waits to run (idle work yields to it)."""
        return not self._queue.empty()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, done, traced = item
            start = self.trace.now()
            try:
                value = fn()
            except BaseException as exc:  # reaches whoever waits on the version
                done.fail_from_exception(exc)
                continue
            if traced and self.trace.enabled:
                lab = done.label
                self.trace.add(TraceRecord(-1, "host", lab.kind, lab.stage, -1, 0, start, self.trace.now(), self.trace.step))
            done.set(value)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (waits up to ``timeout``)."""
        self._queue.put(None)
        self._thread.join(timeout)
