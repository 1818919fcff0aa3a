"""The fake CUDA driver's pinning calls: ``cudaHostRegister`` and its errors, answered on the CPU.

What ``lightning_roundpipe.workers.pinning.PinRegistry`` calls on a GPU (torch's cudart), with CUDA's
page rule: a second registration of a page fails with error 712, and a failed call leaves the
thread's last error set until ``cudaGetLastError``.
"""

from __future__ import annotations

import bisect
import threading

from lightning_roundpipe.workers.pinning import ALREADY_REGISTERED, page_span


class FakeCudart:
    """CUDA's answers to pinning on the CPU: a range touching a registered page fails with 712, a
    failure sets the thread's last error until ``cudaGetLastError``; ``fail_with`` makes every
    registration fail with that code (a host out of lockable memory, for instance)."""

    def __init__(self, fail_with: int = 0) -> None:
        self.fail_with = int(fail_with)
        self.pages: dict[int, int] = {}  # registered start -> end
        # The page spans of ``pages``, disjoint (overlaps are refused), by start: a registration
        # checks its neighbour in O(log n), not every run (thousands of download buffers).
        self._span_starts: list[int] = []
        self._span_ends: dict[int, int] = {}
        self._pages_lock = threading.Lock()
        self._last = threading.local()
        self.register_calls = 0
        self.overlapping_calls = 0  # registrations that touched an already registered page

    @property
    def last_error(self) -> int:
        """The error code of this thread's last failed call (0: none)."""
        return getattr(self._last, "code", 0)

    def _fail(self, code: int) -> int:
        self._last.code = code
        return code

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        """Pin ``nbytes`` at ``ptr`` as CUDA would (page rule, overlaps refused); returns an error code."""
        lo, hi = page_span(ptr, nbytes)
        with self._pages_lock:
            self.register_calls += 1
            # Spans are disjoint, so the one starting last before ``hi`` also ends last.
            i = bisect.bisect_left(self._span_starts, hi) - 1
            if i >= 0 and self._span_ends[self._span_starts[i]] > lo:
                self.overlapping_calls += 1
                return self._fail(ALREADY_REGISTERED)
            if self.fail_with:
                return self._fail(self.fail_with)
            self.pages[ptr] = ptr + nbytes
            self._span_starts.insert(i + 1, lo)
            self._span_ends[lo] = hi
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        """Unpin the registration starting at ``ptr``; returns an error code."""
        with self._pages_lock:
            end = self.pages.pop(ptr, None)
            if end is None:
                return self._fail(713)  # cudaErrorHostMemoryNotRegistered
            lo = page_span(ptr, end - ptr)[0]
            del self._span_starts[bisect.bisect_left(self._span_starts, lo)]
            del self._span_ends[lo]
        return 0

    def cudaGetLastError(self) -> int:
        """Return and clear this thread's last error code."""
        code, self._last.code = self.last_error, 0
        return code

    def is_registered(self, ptr: int) -> bool:
        """Whether the page holding ``ptr`` is registered (what ``cudaPointerGetAttributes`` answers)."""
        with self._pages_lock:
            i = bisect.bisect_right(self._span_starts, ptr) - 1
            return i >= 0 and self._span_ends[self._span_starts[i]] > ptr
