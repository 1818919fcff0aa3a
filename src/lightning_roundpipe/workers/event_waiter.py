"""CUDA only: tell the lanes when a device event completes, instead of lanes polling for it.

One waiter thread per CUDA stream blocks on its stream's oldest awaited event (events on one
stream complete in order), runs the callbacks of every event done by then, and goes on: no
polling, and ``blocking`` events sleep in the driver with the GIL released. A device error
stops the thread after calling every waiter back, so each fails naming its task. Its one limit
(latency, never a hang) and how timeouts still hold: docs/design.md, design notes,
``workers/event_waiter.py``.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Any, Callable

from ..host.threads import WAITING_THREADS, set_intra_op_threads

log = logging.getLogger("lightning_roundpipe")


class StreamEventWaiter:
    """The thread that waits for one stream's awaited events, oldest first."""

    def __init__(self, name: str):
        self._heap: list[tuple[int, int, Any, Callable[[], None]]] = []  # (record order, count, event, fn)
        self._count = 0
        self._cond = threading.Condition()
        self._stopping = False
        self.error: BaseException | None = None  # the device error the thread stopped on
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def add(self, event, fn: Callable[[], None]) -> bool:
        """Call ``fn`` once ``event`` (recorded on this waiter's stream) has completed; False (no call)
        when the thread stopped on a device error: the caller then asks the event itself, which raises."""
        with self._cond:
            if self.error is not None or not self._thread.is_alive():
                return False
            self._count += 1
            heapq.heappush(self._heap, (event.order, self._count, event, fn))
            self._cond.notify()
            return True

    def stop(self) -> None:
        """End the thread once its current wait returns."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the thread to end; whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def name(self) -> str:
        """The thread's name."""
        return self._thread.name

    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def _loop(self) -> None:
        set_intra_op_threads(WAITING_THREADS)  # explicit: unset, a thread takes whatever count was set last
        try:
            self._serve()
        except BaseException as exc:  # a device error (CUDA's are sticky): every waiter is told at once
            with self._cond:
                self.error = exc
                pending, self._heap = self._heap, []
            log.error("%s stopped on a device error; calling back its %d waiter(s): %s",
                      self._thread.name, len(pending), exc)
            for *_, fn in pending:  # each looks at its event, which raises the error in the task it names
                try:
                    fn()
                except Exception:
                    log.exception("a device-event callback failed")

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._stopping:
                    self._cond.wait(timeout=1.0)  # idle: woken by add() or stop()
                if self._stopping:
                    return
                oldest = self._heap[0][2]
            oldest.block()  # GIL released, core yielded (a blocking event); see the module doc
            with self._cond:
                done = []
                while self._heap and self._heap[0][2].query():
                    done.append(heapq.heappop(self._heap)[3])
            for fn in done:
                try:
                    fn()
                except Exception:  # a lane's bookkeeping failed: log it, keep serving the others
                    log.exception("a device-event callback failed")


class EventWaiters:
    """The waiters of one driver, one per stream, created when a stream's first event is awaited."""

    def __init__(self):
        self._by_stream: dict[Any, StreamEventWaiter] = {}  # by the stream itself: equal handles, one waiter
        self._all: list[StreamEventWaiter] = []  # every waiter started, for ``threads_alive``
        self._lock = threading.Lock()
        self._closed = False

    def add(self, event, fn: Callable[[], None]) -> bool:
        """Call ``fn`` when ``event`` completes; True (the call will come), False once closed (no call)."""
        with self._lock:
            if self._closed:
                return False
            waiter = self._by_stream.get(event.stream)
            if waiter is None:
                waiter = StreamEventWaiter(f"roundpipe-event-waiter-{len(self._all)}")
                self._by_stream[event.stream] = waiter  # the stream is kept alive with its waiter
                self._all.append(waiter)
        return waiter.add(event, fn)

    def threads_alive(self) -> list[str]:
        """Names of the waiter threads still running (those ``close`` left behind included)."""
        with self._lock:
            return [w.name for w in self._all if w.alive()]

    def close(self, timeout: float) -> None:
        """Stop every waiter, waiting up to ``timeout`` in all."""
        with self._lock:
            self._closed = True
            waiters = list(self._by_stream.values())
            self._by_stream = {}
        for w in waiters:
            w.stop()
        deadline = time.monotonic() + timeout
        stuck = sum(not w.join(max(0.0, deadline - time.monotonic())) for w in waiters)
        if stuck:
            log.warning("%d CUDA event waiter(s) still wait for an event that did not complete (daemon threads)", stuck)
