"""The process's compile clock: seconds spent compiling, which no timeout and no step time counts.

Dynamo compiles one graph at a time under its lock, inside whatever task first calls a compiled layer,
so on 8 GPUs the first step's compiles can outlast a wait's timeout. The clock keeps the intervals in
which some dynamo compile ran (dynamo's own start/end callbacks, which also cover the lazily compiled
backward and every recompile; overlapping compiles count once), and ``seconds_between`` answers how
many compile seconds fell in any window. A wait's deadline is ``start + timeout + seconds_between(start,
now)``: it ends after ``timeout`` seconds of anything but compiling, and a hang outside a compile still
fails on time (a hang inside one does not). Measuring a wrapper's first call would be simpler but would
exempt a layer that hangs on its first call, and miss recompiles and backward compiles.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Callable


class CompileClock:
    """Intervals (``now``: ``time.monotonic``) during which at least one compile ran; thread-safe."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._lock = threading.Lock()
        self._starts: list[float] = []
        self._ends: list[float] = []  # of each finished interval; the last start may still be open
        self._before: list[float] = []  # compile seconds before each interval
        self._running = 0

    def started(self, *_args) -> None:
        """A compile began (nested or concurrent ones extend the open interval)."""
        with self._lock:
            self._running += 1
            if self._running == 1:
                self._before.append(self._total_locked(None))
                self._starts.append(self._now())

    def ended(self, *_args) -> None:
        """A compile ended (an end without a start, from callbacks registered mid-compile, is ignored)."""
        with self._lock:
            if self._running == 0:
                return
            self._running -= 1
            if self._running == 0:
                self._ends.append(self._now())

    def _total_locked(self, at: float | None) -> float:
        """Compile seconds up to monotonic time ``at`` (None: all so far)."""
        i = len(self._starts) if at is None else bisect.bisect_right(self._starts, at)
        if i == 0:
            return 0.0
        end = self._ends[i - 1] if i - 1 < len(self._ends) else self._now()
        if at is not None:
            end = min(end, at)
        return self._before[i - 1] + max(0.0, end - self._starts[i - 1])

    def seconds(self) -> float:
        """Compile seconds since the process started (never decreases)."""
        with self._lock:
            return self._total_locked(None)

    def seconds_between(self, start: float, end: float | None = None) -> float:
        """Compile seconds between monotonic times ``start`` and ``end`` (default: now)."""
        with self._lock:
            return max(0.0, self._total_locked(end) - self._total_locked(start))

    def compiling(self) -> bool:
        """Whether a compile is running now."""
        with self._lock:
            return self._running > 0

    def watch_dynamo(self) -> None:
        """Feed the clock from dynamo's compile callbacks (again after ``torch._dynamo.reset()``, which
        drops them). A torch without them leaves compiles counted against timeouts."""
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:
            return
        if self.started not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self.started)
            callback_handler.register_end_callback(self.ended)


COMPILE_CLOCK = CompileClock()
"""The process's compile clock (dynamo's compile lock and caches are process-wide too)."""


def wait_excluding_compiles(wait: Callable[[float], bool], timeout: float) -> bool:
    """``wait(seconds)`` (an ``Event.wait``, a ``Lock.acquire``) until it returns True or ``timeout`` seconds
    have passed that were not spent compiling; its last result."""
    start = time.monotonic()
    while True:
        left = start + timeout + COMPILE_CLOCK.seconds_between(start) - time.monotonic()
        if wait(max(0.0, left)):
            return True
        if left <= 0 or start + timeout + COMPILE_CLOCK.seconds_between(start) <= time.monotonic():
            return False
