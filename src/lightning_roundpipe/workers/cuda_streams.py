"""Streams and events: the small interface the stream backend's protocol is written against, on CUDA.

``CudaStreams`` maps it onto CUDA streams and events; the lab's fake driver
(``roundpipe_lab.fake_cuda.streams.FakeStreams``) implements the same interface on CPU threads, so
the protocol runs in CI. ``register_in_place`` is both drivers' pinning in place.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from typing import Any, Callable

import torch

from .completions import TaskLabel
from .event_waiter import EventWaiters
from .pinning import PinRegistry, cuda_pin_registry


def poll_until(done: Callable[[], bool], timeout: float) -> bool:
    """Wait for ``done()`` without spinning a core: sleeps that grow from 20 us to 1 ms."""
    deadline = time.monotonic() + timeout
    pause = 2e-5
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 1e-3)
    return True


def register_in_place(pins: PinRegistry, t: torch.Tensor, storage_pinned: bool) -> bool:
    """Both drivers' ``register``. ``storage_pinned`` is the driver's ``is_pinned(t)``, which ATen
    answers from the page of the *storage's start* only: when that page is one ``pins`` registered
    (for a neighbouring view of the storage), ``t`` itself may still reach into unpinned pages, so
    it is registered like any tensor. When the storage start is pinned by someone else (torch's
    pinned host allocator, which pins whole storages), ``t`` is pinned already: nothing to register."""
    if t.device.type == "cpu" and storage_pinned and not pins.holds(t.untyped_storage().data_ptr()):
        pins.pinned_elsewhere += 1
        return True
    return pins.register(t)


class CudaEvent:
    """A CUDA event created ``blocking`` (a synchronize yields the core) with bounded host waits.
    ``stream`` and ``order`` (a process-wide count) say where and when it was last recorded, so
    that ``StreamEventWaiter`` can wait for a stream's events in the order they complete;
    ``waiters`` (the driver's) tell a host ``wait`` when it completes, without polling."""

    __slots__ = ("raw", "stream", "order", "waiters")
    _orders = itertools.count()

    def __init__(self, timing: bool, waiters: EventWaiters | None = None):
        self.raw = torch.cuda.Event(enable_timing=timing, blocking=True)
        self.stream = None
        self.order = 0
        self.waiters = waiters

    def record(self, stream) -> None:
        """Record the event on ``stream``."""
        self.raw.record(stream)
        self.stream = stream
        self.order = next(CudaEvent._orders)

    def query(self) -> bool:
        """Whether the work before the event is done."""
        return self.raw.query()

    def block(self) -> None:
        """Block until the event completes (the GIL released); raises the device's error (a device-side assert)."""
        self.raw.synchronize()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the event; False when it did not come. Told by the stream's
        waiter thread when there is one (polls with growing sleeps once the driver is closed)."""
        if self.raw.query():
            return True
        arrived = threading.Event()
        if self.stream is not None and self.waiters is not None and self.waiters.add(self, arrived.set):
            return arrived.wait(timeout) or self.raw.query()
        return poll_until(self.raw.query, timeout)

    def seconds_until(self, later: "CudaEvent") -> float:
        """Seconds between this event and ``later`` (timing events)."""
        return self.raw.elapsed_time(later.raw) / 1e3


class CudaStreams:
    """``jitter_cycles``: before each piece of stream work, a ``torch.cuda._sleep`` of a random
    number of GPU cycles in [0, jitter_cycles) on that stream (the race amplifier on a GPU)."""

    kind = "cuda"
    fake = False

    def __init__(self, jitter_cycles: int = 0, seed: int = 0) -> None:
        self._waiters = EventWaiters()
        self.record_stream_calls = 0
        self.jitter_cycles = int(jitter_cycles)
        self._rand = random.Random(seed)
        self._rand_lock = threading.Lock()

    def new_stream(self, device: torch.device):
        """A new stream on ``device``."""
        with torch.cuda.device(device):
            return torch.cuda.Stream(device=device)

    def new_event(self, timing: bool = False) -> CudaEvent:
        """A new event (``timing``: it can measure elapsed time)."""
        return CudaEvent(timing, self._waiters)

    def when_done(self, event: CudaEvent, fn: Callable[[], None]) -> bool:
        """Have ``fn`` called, on the waiter thread of the event's stream, when ``event`` completes;
        False, and no call, when it is done already."""
        return not event.query() and self._waiters.add(event, fn)  # closed (shutdown): False, lanes stop

    def wait_event(self, stream, event: CudaEvent) -> None:
        """Make ``stream`` wait for ``event``."""
        stream.wait_event(event.raw)

    def issue(self, stream, device: torch.device, fn: Callable[[], Any], label: TaskLabel, timeout_s: float) -> Any:
        """Run ``fn`` with ``stream`` current: its kernels and copies are queued on the stream."""
        with torch.cuda.device(device), torch.cuda.stream(stream):
            if self.jitter_cycles > 0:
                with self._rand_lock:
                    cycles = self._rand.randrange(self.jitter_cycles)
                torch.cuda._sleep(cycles)
            return fn()

    def current_stream(self, device: torch.device):
        """The current stream of ``device``."""
        return torch.cuda.current_stream(device)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Mark ``tensor`` as used by ``stream`` (its memory is not reused before the stream gets there)."""
        self.record_stream_calls += 1
        tensor.record_stream(stream)

    def to_device(self, src: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A non-blocking copy of ``src`` to ``device`` in ``dtype``."""
        return src.to(device, dtype=dtype, non_blocking=True)

    def empty_host(self, shape, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """An empty host tensor, pinned when asked."""
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A non-blocking copy of ``src`` into the host tensor ``dst``."""
        dst.copy_(src, non_blocking=True)

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in pinned memory."""
        return t.is_pinned()

    @property
    def pins(self) -> PinRegistry:
        """The process's registry of host memory pinned in place."""
        return cuda_pin_registry()

    def register(self, t: torch.Tensor) -> bool:
        """Pin an existing host tensor in place (``cudaHostRegister``, errors checked and cleared:
        ``pinning.py``); False if it stays pageable (the reason is counted in ``pins.pageable_reasons``)."""
        return register_in_place(self.pins, t, self.is_pinned(t))

    def unregister(self, t: torch.Tensor) -> None:
        """Unpin ``t`` (pinned in place)."""
        self.pins.unregister(t)

    def synchronize(self, device: torch.device, streams, timeout: float) -> bool:
        """Wait (bounded) until every stream of ``device`` in ``streams`` has finished its work."""
        return wait_for_streams(self, streams, timeout)

    def close(self, timeout: float) -> None:
        """Stop the event waiters' threads (CUDA streams themselves have no threads of ours)."""
        self._waiters.close(timeout)


def wait_for_streams(driver, streams, timeout: float) -> bool:
    """Wait up to ``timeout`` in all until each of ``streams`` reached everything queued on it (an event
    of ``driver`` recorded on it completes); False when one did not. The real and fake drivers' ``synchronize``."""
    deadline = time.monotonic() + timeout
    for s in streams:
        ev = driver.new_event()
        ev.record(s)
        if not ev.wait(max(0.0, deadline - time.monotonic())):
            return False
    return True
