"""The fake CUDA driver's streams and events: the stream backend's interface on the CPU.

``FakeStreams`` implements what ``lightning_roundpipe.workers.cuda_streams.CudaStreams`` does on CUDA,
so the same protocol runs in CI: each stream an in-order executor thread, so the issuing lane runs ahead
of the "device" as on a GPU and races between host writes and copies in flight show up
(``jitter_s`` amplifies them). The fake also models pinning (``FakeCudart``), late copies, real (counted) copies,
``record_stream``, sticky device asserts, a per-stream allocator and a residency check. What it models and what it
cannot: docs/design.md, design notes, ``fake_cuda/streams.py``, and ``docs/fake_cuda.md``.
"""

from __future__ import annotations

import collections
import itertools
import random
import weakref
import threading
import time
from typing import Any, Callable

import torch

from lightning_roundpipe.host.threads import set_intra_op_threads
from lightning_roundpipe.workers.completions import Deferred, TaskLabel
from lightning_roundpipe.workers.cuda_streams import register_in_place, wait_for_streams
from lightning_roundpipe.workers.event_waiter import EventWaiters
from lightning_roundpipe.workers.pinning import PinRegistry

from .cudart import FakeCudart


STICKY_ERROR_CLASS = getattr(torch, "AcceleratorError", RuntimeError)  # what torch raises for a CUDA error
STICKY_POLL_S = 0.02  # how often a fake event's wait looks for a sticky device error


class FakeEvent:
    """Completes when the executor of the stream it was recorded on reaches it."""

    __slots__ = ("_done", "_recorded", "time", "_callbacks", "stream", "order", "driver")
    _callbacks_lock = threading.Lock()  # one for all events: registering and completing are a few steps
    _orders = itertools.count()

    def __init__(self, timing: bool = False):
        self._done = threading.Event()
        self._recorded = False
        self.time = 0.0
        self._callbacks: list | None = None
        self.stream = None  # as ``CudaEvent``: the stream object it was last recorded on, kept alive
        self.order = 0
        self.driver: "FakeStreams | None" = None  # whose sticky device error its calls raise

    def complete(self) -> None:
        """Mark the event done (its stream's executor reached it) and run the callbacks of ``when_done``."""
        self.time = time.perf_counter()
        with FakeEvent._callbacks_lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            fn()

    def when_done(self, fn: Callable[[], None]) -> bool:
        """Have ``fn`` called on the executor when the event completes; False (no call) when it is done now."""
        with FakeEvent._callbacks_lock:
            if self.query():
                return False
            if self._callbacks is None:
                self._callbacks = []
            self._callbacks.append(fn)
            return True

    def _check(self) -> None:
        if self.driver is not None:
            self.driver.check()

    def record(self, stream: "FakeStream") -> None:
        """Record the event on the fake ``stream``: it completes when the stream's thread gets there."""
        self._check()
        self._recorded = True
        self.stream = stream
        self.order = next(FakeEvent._orders)
        stream.put(("event", self))

    def recorded(self) -> bool:
        """Whether the event was ever recorded on a stream."""
        return self._recorded

    def query(self) -> bool:
        """Whether the event completed (never recorded counts as done, as on CUDA); raises the
        driver's sticky device error, as ``cudaEventQuery`` returns it."""
        self._check()
        return not self._recorded or self._done.is_set()  # as on CUDA: never recorded means done

    def reached(self, timeout: float) -> bool:
        """The executors' own wait (never raises): whether the event completed within ``timeout``."""
        return not self._recorded or self._done.wait(timeout)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the event; False when it did not come. Raises the driver's
        sticky device error when it is or becomes set (a blocking CUDA event wakes with it)."""
        if self.driver is None:
            return self.reached(timeout)
        deadline = time.monotonic() + timeout
        while True:
            self._check()
            left = deadline - time.monotonic()
            if self.reached(min(STICKY_POLL_S, max(0.0, left))):
                self._check()
                return True
            if left <= 0:
                return False

    def block(self) -> None:
        """Block until the event completes (``cudaEventSynchronize``); raises the sticky device error.
        Returns early once the driver is closed (its stopped streams complete nothing more)."""
        while not self.wait(1.0):
            if self.driver is None or self.driver.closed:
                return

    def seconds_until(self, later: "FakeEvent") -> float:
        """Seconds between this event and ``later``."""
        return later.time - self.time


class FakeStream:
    """One in-order executor thread standing for a CUDA stream."""

    def __init__(self, driver: "FakeStreams", name: str):
        self.driver = driver
        self.name = name
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._after: list = []  # run by this stream's own thread only
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def after_current(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on this executor once the work now running returns, before the next item
        (a copy the work issued, landing later, still ahead of the events recorded after it)."""
        self._after.append(fn)

    def put(self, item) -> None:
        """Queue an item (work, an event or a wait) for the stream's thread."""
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def stop(self) -> None:
        """Tell the stream's thread to end after what is queued."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the stream's thread to end."""
        self._thread.join(timeout)

    def alive(self) -> bool:
        """Whether the stream's thread still runs."""
        return self._thread.is_alive()

    def stop_at(self, event: "FakeEvent") -> None:
        """A wait item: stop here until ``event`` completes (or the stream is stopped)."""
        while not event.reached(0.1):
            if self._stopping or self.driver.device_error is not None:
                break

    def reach(self, event: "FakeEvent") -> None:
        """An event item: the work queued before it has run, so it completes now."""
        event.complete()

    def stopping(self) -> bool:
        """Whether the stream was told to stop."""
        return self._stopping

    def _loop(self) -> None:
        self.driver.local.stream = self
        set_intra_op_threads(self.driver.threads)  # explicit: a new thread inherits the last thread's setting
        while True:
            with self._cond:
                while not self._items and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    for kind, *rest in self._items:  # nothing more runs: let waiters see failures
                        if kind == "work":
                            rest[1].fail(RuntimeError(f"the fake stream {self.name} was stopped before this work ran"))
                    return
                kind, *rest = self._items.popleft()
            if self.driver.device_error is not None:  # the context is lost: nothing runs or completes
                if kind == "work":
                    rest[1].fail(self.driver.sticky_error())
                continue
            if kind == "wait":
                self.stop_at(rest[0])
            elif kind == "event":
                self.reach(rest[0])
            elif kind == "assert":
                self.driver.device_error = rest[0]
            else:
                fn, deferred = rest
                self.driver.pause()
                try:
                    deferred.resolve(fn())
                except BaseException as exc:  # the reader of the value gets it
                    deferred.fail(exc)
                while self._after:
                    self._after.pop(0)()


class FakeStreamHandle:
    """A new object for one fake stream, as each ``torch.cuda.current_stream()`` call returns: it
    compares and hashes as its stream does, and does what its stream does."""

    __slots__ = ("stream",)

    def __init__(self, stream: FakeStream):
        self.stream = stream

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

    def __eq__(self, other) -> bool:
        return self.stream is getattr(other, "stream", other)

    def __hash__(self) -> int:
        return hash(self.stream)


class FakeStreams:
    """CPU stand-in for CUDA streams; ``jitter_s`` delays each piece of stream work at random;
    ``threads``: torch intra-op threads of each executor (1: the executors stand for device
    engines, and one core each keeps N fake devices from oversubscribing the host)."""

    kind = "fake_cuda"
    fake = True
    stream_class = FakeStream  # what ``new_stream`` makes (the emulated driver's streams keep a device clock)
    event_class = FakeEvent

    def __init__(self, jitter_s: float = 0.0, seed: int = 0, cudart=None, copy_delay_s: float = 0.0,
                 threads: int = 1):
        self.threads = max(1, int(threads))
        self.jitter_s = float(jitter_s)
        self.copy_delay_s = float(copy_delay_s)
        self.cudart = cudart if cudart is not None else FakeCudart()
        self.pins = PinRegistry(self.cudart)
        self._stream_held: dict[int, tuple] = {}  # id -> (event, nbytes, storage): freed, held for a stream
        self._held_lock = threading.Lock()
        self._rand = random.Random(seed)
        self._rand_lock = threading.Lock()
        self._streams: list[FakeStream] = []
        self.local = threading.local()
        self.record_stream_calls = 0
        self.device_error: str | None = None  # CUDA's sticky error: once set, every call raises it
        self.closed = False
        self._copies: collections.Counter = collections.Counter()  # host (start, end) of copies issued, not landed
        self._copies_lock = threading.Lock()
        self.use_after_release: list[str] = []  # host memory unregistered while a copy in flight used it
        self._waiters = EventWaiters()  # when_done as on CUDA: a waiter thread per awaited stream
        self.tallies: dict = {}  # stream -> the PoolTally its work allocates through (``allocator.py``)
        self.residency = None  # a ResidencyCheck once ``check_residency_on`` was called
        self._residency_streams: set = set()
        self.to_device_bytes = 0  # bytes copied by ``to_device`` (every host-to-"device" copy)

    def device_assert(self, stream: FakeStream, message: str = "device-side assert triggered") -> None:
        """Queue a kernel that fails a device-side assert on ``stream``: once the stream reaches it,
        the error is sticky, as CUDA's: every later event query, wait, synchronize, record and
        launch raises it, later stream work fails with it, and no later event completes."""
        if getattr(self.local, "stream", None) is stream:  # from the stream's own work: right after it
            stream.after_current(lambda: setattr(self, "device_error", message))
        else:
            stream.put(("assert", message))

    def sticky_error(self) -> BaseException:
        """A new exception for the sticky device error, of the class torch raises for it."""
        return STICKY_ERROR_CLASS(f"CUDA error: {self.device_error}\nCUDA kernel errors might be asynchronously "
                                  f"reported at some other API call (fake driver)")

    def check(self) -> None:
        """Raise the sticky device error if the fake device has one."""
        if self.device_error is not None:
            raise self.sticky_error()

    def pause(self) -> None:
        """Sleep a random time in [0, jitter_s) (the race amplifier)."""
        if self.jitter_s > 0:
            with self._rand_lock:
                delay = self._rand.uniform(0.0, self.jitter_s)
            time.sleep(delay)

    def new_stream(self, device: torch.device, name: str = "") -> FakeStream:
        """A new fake stream, with its executor thread."""
        s = self.stream_class(self, f"roundpipe-stream-{name or len(self._streams)}")
        self._streams.append(s)
        return s

    def new_event(self, timing: bool = False) -> FakeEvent:
        """A new fake event."""
        ev = self.event_class(timing)
        ev.driver = self
        return ev

    def when_done(self, event: FakeEvent, fn: Callable[[], None]) -> bool:
        """Have ``fn`` called, on the waiter thread of the event's stream (as ``CudaStreams`` does),
        when ``event`` completes; False, and no call, when it is done already."""
        return not event.query() and self._waiters.add(event, fn)

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        """Make ``stream`` wait for ``event`` (nothing when it was never recorded)."""
        self.check()
        if event.recorded():
            stream.put(("wait", event))

    def issue(self, stream: FakeStream, device, fn: Callable[[], Any], label: TaskLabel, timeout_s: float) -> Deferred:
        """Queue ``fn`` on ``stream``; returns the ``Deferred`` its result arrives in."""
        self.check()  # a launch returns the sticky error
        if stream in self._residency_streams:  # the work's operators may read only resident tensors
            fn = self.residency.running(fn, label)
        tally = self.tallies.get(stream)
        if tally is not None:  # the caching allocator is modelled: charge what ``fn`` allocates to the stream's pool
            fn = tally.running(fn, label)
        deferred = Deferred(label, timeout_s)
        stream.put(("work", fn, deferred))
        return deferred

    def check_residency_on(self, stream: FakeStream, check) -> None:
        """Fail work on ``stream`` that reads a tensor neither uploaded by ``to_device`` nor made by work on a
        stream (``check``: a ``ResidencyCheck``, ``residency.py``), as CUDA fails a kernel given a host tensor."""
        self.residency = check
        self._residency_streams.add(stream)

    def allocate_on(self, stream: FakeStream, tally) -> None:
        """Charge the tensors that work on ``stream`` creates to ``tally``'s pool (``allocator.py``)."""
        self.tallies[stream] = tally

    def current_stream(self, device) -> "FakeStreamHandle":
        """The stream the calling thread issues to, as CUDA gives it: ``torch.cuda.current_stream``
        builds a new Python object on each call (equal and of equal hash, never the same object)."""
        return FakeStreamHandle(self.local.stream)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """As CUDA's allocator: when ``tensor`` is freed, its memory stays held until ``stream``
        has run everything queued on it at that moment (``stream_held_bytes`` counts it)."""
        self.record_stream_calls += 1
        weakref.finalize(tensor, self._hold_for_stream, stream, tensor.untyped_storage(),
                         tensor.numel() * tensor.element_size())

    def _hold_for_stream(self, stream, storage, nbytes: int) -> None:
        ev = FakeEvent()
        ev.record(stream)
        with self._held_lock:
            self._stream_held[id(ev)] = (ev, nbytes, storage)

    def stream_held_bytes(self) -> int:
        """Bytes of freed tensors whose memory a ``record_stream`` still holds (dropped once their stream
        passed)."""
        with self._held_lock:
            for k in [k for k, (ev, _, _) in self._stream_held.items() if ev.query()]:
                del self._stream_held[k]
            return sum(n for _, n, _ in self._stream_held.values())

    def _copy_begins(self, host: torch.Tensor):
        span = (host.data_ptr(), host.data_ptr() + host.numel() * host.element_size())
        with self._copies_lock:
            self._copies[span] += 1
        return span

    def _copy_lands(self, span) -> None:
        with self._copies_lock:
            self._copies[span] -= 1
            if self._copies[span] <= 0:
                del self._copies[span]

    def copies_in_flight(self) -> int:
        """Host-side copies issued on a stream that have not landed."""
        with self._copies_lock:
            return sum(self._copies.values())

    def to_device(self, src: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
        """A distinct copy of ``src`` in ``dtype`` (the device is host memory here), never sharing its storage."""
        span = self._copy_begins(src)
        try:
            out = src.to(dtype=dtype, copy=True)  # runs on the stream's executor: the "copy engine"
        finally:
            self._copy_lands(span)
        with self._copies_lock:
            self.to_device_bytes += src.numel() * src.element_size()
        if self.residency is not None:
            self.residency.add(out)
        return out

    def empty_host(self, shape, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """An empty host tensor (pinning is registered, not allocated, on this driver)."""
        return torch.empty(shape, dtype=dtype)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst``, landing ``copy_delay_s`` late when issued on a stream."""
        stream = getattr(self.local, "stream", None)
        if self.copy_delay_s > 0 and stream is not None:
            span = self._copy_begins(dst)  # in flight from now until it lands, as a non-blocking copy

            def land():
                time.sleep(self.copy_delay_s)
                dst.copy_(src)
                self._copy_lands(span)

            stream.after_current(land)
        else:
            dst.copy_(src)

    def is_pinned(self, t: torch.Tensor) -> bool:
        """ATen's answer: whether the page holding the *start of ``t``'s storage* is registered (not
        ``t`` itself: a view that starts further on, or reaches past that page, gets its storage's answer)."""
        if t.device.type != "cpu":
            return False
        start = t.untyped_storage().data_ptr()
        return start != 0 and self.cudart.is_registered(start)

    def register(self, t: torch.Tensor) -> bool:
        """Pin ``t`` in place with the fake driver, by the same rule as ``CudaStreams.register``;
        False when it stays pageable."""
        return register_in_place(self.pins, t, self.is_pinned(t))

    def unregister(self, t: torch.Tensor) -> None:
        """Unpin ``t``. Memory a copy in flight still reads or writes is recorded in ``use_after_release``
        (on CUDA the copy would go on into memory no longer pinned, or freed and reused)."""
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        with self._copies_lock:
            hit = [span for span in self._copies if span[0] < hi and lo < span[1]]
        if hit:
            self.use_after_release.append(f"unregistered {hi - lo} bytes at {lo:#x} while {len(hit)} copy(ies) "
                                          f"in flight used them")
        self.pins.unregister(t)

    def synchronize(self, device, streams, timeout: float) -> bool:
        """Wait up to ``timeout`` until ``streams`` reached everything queued; False when they did not."""
        return wait_for_streams(self, streams, timeout)

    def close(self, timeout: float) -> None:
        """Stop every stream's thread and the event waiters, waiting up to ``timeout`` in all."""
        self.closed = True
        for s in self._streams:
            s.stop()
        deadline = time.monotonic() + timeout
        for s in self._streams:
            s.join(max(0.0, deadline - time.monotonic()))
        self._waiters.close(max(0.0, deadline - time.monotonic()))

    def threads_alive(self) -> list[str]:
        """Names of the stream threads and event waiters still running."""
        return [s.name for s in self._streams if s.alive()] + self._waiters.threads_alive()
