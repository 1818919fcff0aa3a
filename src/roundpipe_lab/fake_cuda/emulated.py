"""Emulated GPUs: the fake-stream backend whose device work takes the time a hardware profile gives it.

The ``fake_cuda`` protocol unchanged (all host code real), plus a device clock per stream: events
complete when the clock says the device got there, so a busy emulated device costs the host
nothing and a launch-bound task shows as late (``late_seconds``). Device times come from a
``device_time(label, nbytes)`` callable, in the benchmarks ``cost.task_seconds.ProfileDeviceTimes``
(the simulator's prices); ``time_scale`` scales them. How the clock moves: docs/design.md, design
notes, ``fake_cuda/emulated.py``; results: docs/emulated_gpus.md.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Callable

from lightning_roundpipe.schedule.graph_task import TRANSFER_LANES, TaskKind
from lightning_roundpipe.workers.completions import Lane, TaskLabel, WorkOrder
from .pool import FakeCudaWorkerPool
from lightning_roundpipe.workers.host_buffers import DEFAULT_CAP_BYTES
from .streams import FakeEvent, FakeStream, FakeStreams
from lightning_roundpipe.host.threads import WAITING_THREADS, set_intra_op_threads

DeviceTime = Callable[[TaskLabel, int], float]


class EmulatedEvent(FakeEvent):
    """A fake event with the emulated device's two moments: ``passed`` is set when the executor of
    its stream reaches it (the work before it has run: its data is there), ``due`` is when the
    stream's device clock gets there (when it completes)."""

    __slots__ = ("passed", "due")

    def __init__(self, timing: bool = False):
        super().__init__(timing)
        self.passed = threading.Event()
        self.due = 0.0


class LinkClock:
    """When a worker's one host link is next free (profiles whose link is not duplex)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.clock = 0.0


class EmulatedStream(FakeStream):
    """A fake stream with a device clock: ``clock`` is when its device has done everything it was
    given so far (``time.perf_counter`` seconds); ``timed`` counts its events the clock thread has
    yet to complete (so that its events complete in order)."""

    def __init__(self, driver: "EmulatedStreams", name: str):
        self.clock = 0.0
        self.timed = 0
        super().__init__(driver, name)

    def advance(self, launched_at: float, seconds: float, link: LinkClock | None = None) -> float:
        """The work launched from ``launched_at`` until now lasts ``seconds`` on the device: it starts
        when the device is free (and the link, for a transfer sharing one) and ends no earlier than
        its launches. Returns the seconds its launches ran past its device time (launch-bound)."""
        now = time.perf_counter()
        start = max(self.clock, launched_at)
        if link is None:
            self.clock = max(now, start + seconds)
        else:
            with link.lock:
                start = max(start, link.clock)
                self.clock = link.clock = max(now, start + seconds)
        return max(0.0, now - (start + seconds))

    def stop_at(self, event: FakeEvent) -> None:
        """Wait until the other stream's executor has passed ``event`` (its data is there); the
        device then waits for the event's time."""
        if not isinstance(event, EmulatedEvent):
            super().stop_at(event)
            return
        while not event.passed.wait(0.1):
            if self.stopping():
                return
        self.clock = max(self.clock, event.due)

    def reach(self, event: FakeEvent) -> None:
        """Complete ``event`` when the device clock gets there: now if it is there and no earlier
        event of this stream is still waiting, else on the driver's clock thread."""
        now = time.perf_counter()
        due = max(self.clock, now)
        if isinstance(event, EmulatedEvent):
            event.due = due
            event.passed.set()
        if not self.driver.complete_at(due, event, self, now):
            event.complete()


class EmulatedStreams(FakeStreams):
    """The fake-stream driver of the emulated backend: ``EmulatedStream``s, ``EmulatedEvent``s and
    one clock thread that completes events at their device time."""

    stream_class = EmulatedStream
    event_class = EmulatedEvent

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._due: list = []  # heap of (due, order, event, stream)
        self._order = itertools.count()
        self._due_cond = threading.Condition()
        self._closing = False
        self._clock_thread = threading.Thread(target=self._complete_due, name="roundpipe-stream-clock", daemon=True)
        self._clock_thread.start()

    def when_done(self, event: FakeEvent, fn) -> bool:
        """Have ``fn`` called on the thread that completes ``event`` (its executor or the clock thread);
        False when it is done already. No waiter thread: the emulated backend's timings are calibrated
        on this cheaper path (only who calls back differs from ``FakeStreams``)."""
        return event.when_done(fn)

    def complete_at(self, due: float, event: FakeEvent, stream: EmulatedStream, now: float) -> bool:
        """Have the clock thread complete ``event`` at ``due``; False (the caller completes it now)
        when it is due already and nothing of ``stream`` is still waiting, or the driver is closed."""
        with self._due_cond:
            if self._closing or (due <= now and stream.timed == 0):
                return False
            stream.timed += 1
            heapq.heappush(self._due, (due, next(self._order), event, stream))
            self._due_cond.notify()
            return True

    def _complete_due(self) -> None:
        set_intra_op_threads(WAITING_THREADS)  # explicit: unset, a thread takes whatever count was set last
        cond = self._due_cond
        while True:
            with cond:
                while True:
                    if self._due:
                        left = self._due[0][0] - time.perf_counter()
                        if left <= 0 or self._closing:
                            _, _, event, stream = heapq.heappop(self._due)
                            break
                        cond.wait(left)
                    elif self._closing:
                        return
                    else:
                        cond.wait()
            event.complete()
            with cond:
                stream.timed -= 1

    def close(self, timeout: float) -> None:
        """Stop the streams, then the clock thread (completing what it still holds)."""
        super().close(timeout)
        with self._due_cond:
            self._closing = True
            self._due_cond.notify()
        self._clock_thread.join(timeout)

    def threads_alive(self) -> list[str]:
        """Names of the stream threads (and the clock thread) still running."""
        clock = [self._clock_thread.name] if self._clock_thread.is_alive() else []
        return super().threads_alive() + clock


class EmulatedWorkerPool(FakeCudaWorkerPool):
    """The fake-stream pool with device time (see the module doc): ``time_scale`` multiplies every
    device time; ``duplex=False`` makes a worker's uploads and downloads share one link. The device
    times come from ``emulate`` (until then tasks take their real time). ``device_seconds`` sums,
    per worker, the device time charged so far (what the tests check against hand-computed steps)."""

    backend = "emulated"
    driver_class = EmulatedStreams

    def __init__(self, num_workers: int, timeout_s: float = 300.0, trace=None, max_in_flight: int = 2,
                 pin_memory: bool = True, fifo_transfers: bool = False, stream_jitter_s: float = 0.0, seed: int = 0,
                 host_buffer_cap_bytes: int = DEFAULT_CAP_BYTES, cudart=None, copy_delay_s: float = 0.0,
                 time_scale: float = 1.0, duplex: bool = True):
        if not time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        super().__init__(num_workers, timeout_s=timeout_s, trace=trace, max_in_flight=max_in_flight,
                         pin_memory=pin_memory, fifo_transfers=fifo_transfers, stream_jitter_s=stream_jitter_s,
                         seed=seed, host_buffer_cap_bytes=host_buffer_cap_bytes, cudart=cudart,
                         copy_delay_s=copy_delay_s)
        self.time_scale = float(time_scale)
        self.duplex = duplex
        self.device_time: DeviceTime | None = None
        self.device_seconds = [0.0] * num_workers
        self.late_seconds = [0.0] * num_workers  # real work that ran past its device time (launch-bound)
        self._links = [LinkClock() for _ in range(num_workers)]
        self._charge_lock = threading.Lock()

    def emulate(self, device_time: DeviceTime | None, time_scale: float | None = None,
                duplex: bool | None = None) -> "EmulatedWorkerPool":
        """Give every later task the device time ``device_time(label, nbytes)`` (times ``time_scale``);
        None: real time again. Returns the pool."""
        if time_scale is not None:
            if not time_scale > 0:
                raise ValueError(f"time_scale must be positive, got {time_scale}")
            self.time_scale = float(time_scale)
        if duplex is not None:
            self.duplex = duplex
        self.device_time = device_time
        return self

    def execute(self, lane: Lane, task: WorkOrder) -> None:
        """Issue ``task`` as the fake-stream pool does, its work made to last its device time."""
        label = task.done.label
        if self.device_time is not None and label.kind != TaskKind.RELEASE:
            seconds = self.device_time(label, task.nbytes) * self.time_scale
            task.fn = self._timed(task.fn, seconds, lane.worker.index, lane.queue in TRANSFER_LANES)
        super().execute(lane, task)

    def _timed(self, fn, seconds: float, worker: int, transfer: bool):
        """``fn``, then its stream's device clock moved on by ``seconds`` (see the module doc)."""
        link = self._links[worker] if transfer and not self.duplex else None
        local = self.driver.local

        def run():
            launched_at = time.perf_counter()
            out = fn()
            late = local.stream.advance(launched_at, seconds, link)
            with self._charge_lock:
                self.device_seconds[worker] += seconds
                self.late_seconds[worker] += late
            return out

        return run
