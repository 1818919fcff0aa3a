"""Stream backends: the CUDA protocol, run on CUDA streams (``cuda_streams.py``) or on the lab's fake streams.

Per worker an upload, a compute and a download stream, one per lane: a lane makes its stream
wait for the dependencies' events, issues the task and records an event, so the host blocks only
where it reads data. Frees are ordered by events (``stream_holds.py``); transfers are issued
only once their dependencies finished, so priorities hold on FIFO streams; host tensors the
uploads read are pinned once, in place, and downloads land in reusable page-aligned buffers.
Why each rule: docs/design.md, design notes, ``workers/cuda.py``.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Iterable

import torch

from ..schedule.graph_task import TaskKind
from ..cost.device_overheads import TWO_POOL_SHARE, device_reserved_bytes, two_pool_budget_bytes  # noqa: F401 (TWO_POOL_SHARE re-exported)
from ..errors import PipelineTimeout
from .completions import Completion, Deferred, worker_error
from .host_buffers import DEFAULT_CAP_BYTES, HostBufferPool
from .pinning import PAGE, page_span

IN_FLIGHT_BYTES = 64 << 20  # a transfer lane's issued, unfinished copies: two 32 MiB chunks' worth
TRANSFER_DRAIN_S = 5.0  # the most a shutdown waits for the copies in flight before it releases their memory
from .pool import Lane, Task, Worker, WorkerPool
from .stream_holds import StreamHolds
from .cuda_streams import CudaStreams
from ..tracing.records import TraceRecord

log = logging.getLogger("lightning_roundpipe")


class StreamWorkerPool(WorkerPool):
    """The stream protocol over a driver (``CudaStreams`` or ``FakeStreams``)."""

    def __init__(self, driver, devices, timeout_s: float = 300.0, trace=None, max_in_flight: int = 2,
                 pin_memory: bool = True, fifo_transfers: bool = False,
                 host_buffer_cap_bytes: int = DEFAULT_CAP_BYTES):
        """``host_buffer_cap_bytes``: the most bytes of free download buffers kept for reuse (the
        oldest returned are evicted and unpinned beyond it; 2 GiB by default)."""
        super().__init__(devices, timeout_s=timeout_s, trace=trace, fifo_transfers=fifo_transfers)
        self.driver = driver
        self.max_in_flight = max(1, int(max_in_flight))
        # Bytes of issued, unfinished copies a transfer lane allows (two upload chunks' worth);
        # a single larger copy still goes alone.
        self.max_in_flight_bytes = IN_FLIGHT_BYTES
        self.pin_memory = pin_memory  # download buffers in pinned memory
        self._in_flight: dict[int, collections.deque] = {}
        self._timings: list = []  # (lane, label, nbytes, step, start event, end event), read in finish_step
        self._timing_lock = threading.Lock()
        self._pinned: list[torch.Tensor] = []
        self.pinned_bytes = 0
        self.pageable_upload_bytes = 0
        self.host_buffers = HostBufferPool(self._new_host_buffer, self._drop_host_buffer, host_buffer_cap_bytes)
        self._buffer_pins: dict[int, torch.Tensor] = {}
        self.holds = StreamHolds()
        self._deferred_releases: dict[int, Task] = {}  # cancelled releases waiting for their device work
        self.download_pinned_bytes = 0
        for w in self.workers:
            for lane in w.lanes.values():
                lane.stream = self._new_stream(w, lane.queue)
                self._in_flight[id(lane)] = collections.deque()
        self._clock = {w.device: self._new_stream(w, "clock") for w in self.workers}

    def _new_stream(self, worker: Worker, queue: str):
        if self.driver.fake:
            return self.driver.new_stream(worker.device, f"w{worker.index}-{queue}")
        return self.driver.new_stream(worker.device)

    # ------------------------------------------------------------------ the protocol
    def ready_for(self, lane: Lane, dep: Completion) -> bool:
        if not dep.is_set():
            return False
        if lane.queue == "compute" or dep.device_event is None:
            return True
        try:
            return dep.device_event.query()
        except Exception:  # a device error: the task runs now and fails on it, naming itself (execute)
            return True

    def notify_when_device_done(self, dep: Completion, fn) -> bool:
        """The driver calls ``fn`` when ``dep``'s device event completes (the fake stream's executor
        reaching it; on CUDA a waiter thread blocked on the event): lanes never poll for it. False
        (the task goes on, and meets the error in ``execute``) when the device reports an error."""
        try:
            return self.driver.when_done(dep.device_event, fn)
        except Exception:
            return False

    def execute(self, lane: Lane, task: Task) -> None:
        self.holds.collect()
        if task.done.label.kind == TaskKind.RELEASE:
            self._release(task)
            return
        drv = self.driver
        stream = lane.stream
        in_flight = self._in_flight[id(lane)]
        if lane.queue != "compute":
            while in_flight and (len(in_flight) >= self.max_in_flight
                                 or sum(n for _, n in in_flight) + task.nbytes > self.max_in_flight_bytes):
                if not in_flight[0][0].wait(self.timeout_s):
                    raise PipelineTimeout(
                        f"[{task.done.label}] timed out after {self.timeout_s:g}s: the {lane.queue} stream of worker "
                        f"{lane.worker.index} did not finish an earlier copy"
                    )
                in_flight.popleft()
        for dep in task.deps:
            if dep.device_event is not None:
                drv.wait_event(stream, dep.device_event)
        timed = self.trace.recording and task.done.label.kind != TaskKind.RELEASE
        start = None
        if timed:
            start = drv.new_event(timing=True)
            start.record(stream)
        # What this compute reads from another stream (its uploads), held until its end event:
        # taken before the issue, since the task drops the values it was the last reader of.
        reads = ([d.raw_value() for d in task.deps if d.label.queue == "upload" and d.label.worker == lane.worker.index]
                 if lane.queue == "compute" else [])
        fn = task.fn
        if drv.fake:  # what a dependency's failed work would have raised on the host, at its issue, on CUDA
            fn = _after_inputs(fn, [d.raw_value() for d in task.deps if isinstance(d.raw_value(), Deferred)])
        value = drv.issue(stream, lane.worker.device, fn, task.done.label, self.timeout_s)
        end = drv.new_event(timing=timed)
        end.record(stream)
        self.holds.hold(stream, end, [r for r in reads if r is not None])
        task.done.device_event = end
        if lane.queue != "compute":
            in_flight.append((end, task.nbytes))
        if timed:
            with self._timing_lock:
                self._timings.append((lane, task.done.label, task.nbytes, task.step, start, end))
        task.done.set(value)

    def _release(self, task: Task) -> None:
        """A release only drops the stage's device tensors: run it on the host once the device work
        that read them (its dependencies: the stage's last compute, its gradient downloads) has
        finished, so the memory is free for reuse at once (no ``record_stream``). ``ready_for`` only
        lets a release run then; the bounded wait here is the guard should that ever change."""
        deadline = time.monotonic() + self.timeout_s
        for dep in task.deps:
            ev = dep.device_event
            if ev is not None and not ev.wait(max(0.0, deadline - time.monotonic())):
                raise PipelineTimeout(f"[{task.done.label}] timed out after {self.timeout_s:g}s waiting for the device "
                                      f"work of [{dep.label}] before freeing its memory")
        task.done.set(task.fn())

    def run_cancelled_release(self, task: Task) -> None:
        """A release ``cancel_pending`` took: run it once the device work of its dependencies (the
        stage's computes and downloads, which read what it frees) has finished, told by the driver,
        never waiting here. Until then the memory stays held (a device error counts as finished:
        the device runs nothing more)."""
        pending = [d.device_event for d in task.deps if d.device_event is not None and not _finished(d.device_event)]
        left = [len(pending)]
        lock = threading.Lock()

        def one_done() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0 and self._deferred_releases.pop(id(task), None) is not None
            if last:
                super(StreamWorkerPool, self).run_cancelled_release(task)

        if not pending:
            super().run_cancelled_release(task)
            return
        with lock:
            self._deferred_releases[id(task)] = task
        for ev in pending:
            try:
                told = self.driver.when_done(ev, one_done)
            except Exception:  # a device error: nothing runs any more
                told = False
            if not told:  # finished meanwhile, or the driver is closed: ``on_shutdown`` drained the streams
                one_done()

    def finish_step(self) -> None:
        """Read the timing events of every task issued so far, once: per device an anchor event on an
        idle stream gives the host time of "now", and each record is placed relative to it."""
        with self._timing_lock:
            pending, self._timings = self._timings, []
        if not pending:
            return
        anchors = {}
        for device, clock in self._clock.items():
            ev = self.driver.new_event(timing=True)
            ev.record(clock)
            anchors[device] = ev
        unfinished = []
        deadline = time.monotonic() + self.timeout_s
        for item in pending:
            lane, label, nbytes, step, start, end = item
            anchor = anchors[lane.worker.device]
            left = max(0.0, deadline - time.monotonic())
            try:
                finished = end.wait(left) and anchor.wait(left)
            except Exception as exc:  # a device error: name the task whose timing was read
                raise worker_error(label, exc) from exc
            if not finished:
                unfinished.append(item)
                continue
            now = self.trace.now()
            # The anchor completes a moment after it is recorded; taking "now" after waiting
            # for it makes every record end slightly late, never early.
            t_end = now - end.seconds_until(anchor)
            t_start = now - start.seconds_until(anchor)
            self.trace.add(TraceRecord(lane.worker.index, lane.queue, label.kind, label.stage, label.microbatch,
                                       nbytes, t_start, t_end, step))
        if unfinished:
            with self._timing_lock:
                self._timings = unfinished + self._timings

    def synchronize(self, timeout: float | None = None) -> None:
        timeout = self.timeout_s if timeout is None else timeout
        for w in self.workers:
            streams = [lane.stream for lane in w.lanes.values()]
            if not self.driver.synchronize(w.device, streams, timeout):
                raise PipelineTimeout(f"the streams of worker {w.index} did not finish within {timeout:g}s\n"
                                      f"{self.diagnose()}")
        self.holds.collect()

    def on_shutdown(self, timeout: float) -> None:
        """Drain the transfer streams (their copies read and write the host memory released below),
        bounded by ``max(timeout, TRANSFER_DRAIN_S)``, stop the driver, then unpin and drop. Copies that
        did not land by then keep their memory: it stays pinned and held (logged), never released
        under a copy. Transfer streams never wait for unfinished work (``ready_for``), so on a working
        device they drain in the time of their last ``max_in_flight`` copies."""
        start = time.monotonic()
        deadline = start + max(timeout, TRANSFER_DRAIN_S)
        drained = True
        for w in self.workers:
            streams = [lane.stream for lane in w.lanes.values() if lane.queue != "compute"]
            try:
                drained &= self.driver.synchronize(w.device, streams, max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # a device error: the device runs nothing more
                log.warning("draining the streams of worker %d at shutdown: %s", w.index, exc)
        self.driver.close(max(0.0, timeout - (time.monotonic() - start)))  # what is left of the caller's timeout
        for task in list(self._deferred_releases.values()):  # the driver calls back no more: run those now safe
            if (all(d.device_event is None or _finished(d.device_event) for d in task.deps)
                    and self._deferred_releases.pop(id(task), None) is not None):
                super().run_cancelled_release(task)
        if not drained:
            log.error("copies of the transfer streams did not land within %.1fs of shutdown: their host memory "
                      "stays pinned and held (%d bytes), never released under a copy",
                      max(timeout, TRANSFER_DRAIN_S), self.pinned_host_bytes())
            return
        self.holds.clear()
        self.unpin()
        for t in self._buffer_pins.values():
            self.driver.unregister(t)
        self._buffer_pins = {}
        self.download_pinned_bytes = 0
        self.host_buffers.clear()

    def threads_alive(self) -> list[str]:
        fake = self.driver.threads_alive() if self.driver.fake else []
        return super().threads_alive() + fake

    # ------------------------------------------------------------------ copies
    def copy_to_device(self, worker: Worker, tensors, dtypes, read_only=False):
        drv = self.driver
        flags = list(read_only) if isinstance(read_only, (list, tuple)) else [read_only] * len(tensors)
        out = []
        for t, dt, weight in zip(tensors, dtypes, flags):
            if t is None:
                out.append(None)
                continue
            src = t.detach()
            if weight and not drv.is_pinned(src):
                self.pageable_upload_bytes += src.numel() * src.element_size()
            out.append(drv.to_device(src, worker.device, dt or src.dtype))  # held by its computes (execute)
        return out

    def copy_to_host(self, worker: Worker, tensors, reusable: bool = False):
        drv = self.driver
        stream = self._lane_stream(worker, drv.current_stream(worker.device))
        out, sources = [], []
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            t = t.detach()
            sources.append(t)
            if reusable:
                host = self.host_buffers.take(t.shape, t.dtype)
            else:
                host = drv.empty_host(t.shape, t.dtype, pinned=self.pin_memory)
            drv.to_host(host, t)
            out.append(host)
        if sources:
            # After the copies: the sources are held until they have been read, and a lent buffer
            # is not lent again before its data has landed (whoever hands it back, and when).
            landed = drv.new_event()
            landed.record(stream)
            self.holds.hold(stream, landed, sources)
            if reusable:
                self.host_buffers.fence(out, landed)
        return out

    @staticmethod
    def _lane_stream(worker: Worker, current):
        """The lane's own stream object for ``current``: CUDA's ``current_stream()`` is a new Python
        object on each call (equal, never the same), so holds and event waiters keyed by it would
        gain an entry per call."""
        return next((lane.stream for lane in worker.lanes.values() if lane.stream == current), current)

    def release_host(self, tensors) -> None:
        self.host_buffers.give_back(tensors)

    def _new_host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A download buffer of exactly its size: pageable memory, pinned in place when ``pin_memory``
        (never the caching host allocator, which rounds up and keeps what it rounded)."""
        buf = _page_aligned_empty(shape, dtype)
        if self.pin_memory and self.driver.register(buf):
            self._buffer_pins[id(buf)] = buf
            self.download_pinned_bytes += buf.numel() * buf.element_size()
        return buf

    def _drop_host_buffer(self, buf: torch.Tensor) -> None:
        """The buffer pool evicted ``buf`` (its copy has landed): unpin it."""
        if self._buffer_pins.pop(id(buf), None) is not None:
            self.driver.unregister(buf)
            self.download_pinned_bytes -= buf.numel() * buf.element_size()

    @property
    def pageable_reasons(self) -> dict:
        """Why host tensors meant to be pinned stayed pageable, with counts (registration errors, ...)."""
        return dict(self.driver.pins.pageable_reasons)

    # ------------------------------------------------------------------ pinned memory
    def pin_uploads(self, policy: str, tensors: Iterable[torch.Tensor]) -> int:
        """Apply a pinned policy to the host tensors the uploads read (shadows where they exist,
        else the masters): "alloc" and "register" pin each of them in place, once (exact size, no
        staging copy per upload); "off" pins nothing and keeps download buffers pageable.
        Returns the bytes pinned."""
        self.pin_memory = policy != "off"
        if policy == "off":
            return 0
        seen = set()
        pageable = 0
        reasons_before = collections.Counter(self.pageable_reasons)
        for t in tensors:
            if id(t) in seen:  # a tensor whose pages are pinned already is registered without a call
                continue
            seen.add(id(t))
            if self.driver.register(t):
                self._pinned.append(t)
                self.pinned_bytes += t.numel() * t.element_size()
            else:
                pageable += t.numel() * t.element_size()
        if pageable:
            reasons = collections.Counter(self.pageable_reasons) - reasons_before  # this call's (the registry is shared)
            log.warning("pinned=%r: %d bytes the uploads read stay pageable (their copies are synchronous): %s",
                        policy, pageable, "; ".join(f"{why}: {n}" for why, n in reasons.items())
                        or "no reason was counted (a defect: please report it)")
        return self.pinned_bytes

    def pinned_host_bytes(self) -> int:
        """Upload sources pinned by ``pin_uploads`` plus the pinned download buffers kept now."""
        return self.pinned_bytes + self.download_pinned_bytes

    def step_peak_device_bytes(self) -> list[int]:
        """Per worker, the larger of the ledger's peak and, on real CUDA, the caching allocator's peak of
        its device (``torch.cuda.max_memory_allocated``: activations and transients included; workers
        sharing one device report that device's peak)."""
        ledger = self.peak_device_bytes()
        if self.driver.fake:
            return ledger
        return [max(held, torch.cuda.max_memory_allocated(w.device)) for held, w in zip(ledger, self.workers)]

    def reset_step_peaks(self) -> None:
        super().reset_step_peaks()
        if not self.driver.fake:
            for device in {w.device for w in self.workers}:
                torch.cuda.reset_peak_memory_stats(device)

    def device_memory_stats(self) -> list[dict]:
        """Per worker, its GPU's caching allocator since the last ``reset_step_peaks``: ``allocated_peak_bytes``,
        ``reserved_peak_bytes``, ``alloc_retries`` (``num_alloc_retries``: frees of every cached block after a
        failed allocation, each a device synchronize) and ``ooms`` (workers sharing a GPU report that GPU's)."""
        out = []
        for w in self.workers:
            stats = torch.cuda.memory_stats(w.device)
            out.append(dict(allocated_peak_bytes=stats.get("allocated_bytes.all.peak", 0),
                            reserved_peak_bytes=stats.get("reserved_bytes.all.peak", 0),
                            alloc_retries=stats.get("num_alloc_retries", 0), ooms=stats.get("num_ooms", 0)))
        return out

    def unpin(self) -> None:
        """Unregister the host tensors this pool pinned in place."""
        for t in self._pinned:
            self.driver.unregister(t)
        self._pinned = []
        self.pinned_bytes = 0


def _after_inputs(fn, inputs: list[Deferred]):
    """``fn``, run on a fake stream after its dependencies' work (its stream waits for their events), failing
    instead with the first error of that work. On CUDA an allocation fails on the host, at the issue (an
    out-of-memory error fails the task, and its dependants never run); on the fake driver the work allocates
    on its stream, after the issue: without this, a compute would run on the ``None`` of a failed upload."""
    if not inputs:
        return fn

    def run():
        for d in inputs:
            err = d.failed()
            if err is not None:
                raise err
        return fn()

    return run


def _finished(event) -> bool:
    """Whether ``event`` completed; a device error counts as finished (nothing runs any more)."""
    try:
        return event.query()
    except Exception:
        return True


def _page_aligned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor that starts on a page and owns every page it touches: pinning it never
    shares a page with another allocation (CUDA would refuse a second registration of that page)."""
    nbytes = 1
    for d in shape:
        nbytes *= int(d)
    nbytes *= torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(page_span(0, nbytes)[1] + PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % PAGE
    return raw[off:off + nbytes].view(dtype).view(tuple(shape))


TRITON_MIN_CAPABILITY = (7, 0)  # the oldest GPUs inductor's Triton kernels run on (Volta)


def inductor_generates_gpu_code(device_indices=None) -> bool:
    """Whether ``torch.compile``'s inductor can generate kernels for these GPUs (default: GPU 0):
    CUDA available, the ``triton`` package installed (inductor's GPU code generator, shipped with
    torch's CUDA wheels) and every GPU of compute capability ``TRITON_MIN_CAPABILITY`` or newer.
    Where it cannot, ``compile_layers=None`` keeps eager layers instead of failing at the first step."""
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return False
    indices = list(device_indices) if device_indices is not None else [0]
    return all(torch.cuda.get_device_capability(int(i)) >= TRITON_MIN_CAPABILITY for i in indices)


MEMORY_FRACTION = 0.9  # of what a GPU leaves after its context and workspaces: planning.capacity's default (tested)
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_expandable_segments() -> bool:
    """Turn on the caching allocator's ``expandable_segments`` (what the memory model assumes,
    ``cost/device_overheads.py``) unless the user configured it in ``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF``; it applies to the segments allocated from then on. Returns whether it set it."""
    if any("expandable_segments" in os.environ.get(name, "") for name in ALLOC_CONF_VARIABLES):
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")
    return True


def gpu_budget_bytes(total_bytes: int, capability: tuple[int, int]) -> int:
    """The runtime planner's per-worker budget on a GPU of ``total_bytes``: ``TWO_POOL_SHARE`` of what the memory
    model lets a worker's tensors fill (``usable_gpu_bytes``: ``MEMORY_FRACTION`` of the GPU less its CUDA context,
    cuBLAS workspaces and allocator pages, ``device_reserved_bytes``; an SM 9.x card's larger cuBLASLt workspace
    included), so that the two allocation pools' reserved bytes fit it."""
    return two_pool_budget_bytes(usable_bytes(total_bytes, capability))


def usable_bytes(total_bytes: int, capability: tuple[int, int]) -> int:
    """What the memory model lets a worker's tensors fill on a GPU of ``total_bytes``, as ``planning/capacity.py``
    plans it: ``MEMORY_FRACTION`` of the GPU less its context, workspaces and allocator pages."""
    return int(MEMORY_FRACTION * max(0, total_bytes - device_reserved_bytes(sm90=capability[0] == 9)))


class CudaWorkerPool(StreamWorkerPool):
    """The CUDA backend: one worker per entry of ``device_indices``, each with its own streams.

    Allocation pools: the caching allocator keeps one pool per stream, and blocks freed on one
    stream are reused only by allocations on that stream. Uploaded tensors (weights, activation
    and gradient uploads) are allocated on the upload stream, computed ones on the compute
    stream. Allocating the uploads in the compute stream's pool instead is not safe without
    ordering the upload after everything queued on the compute stream (a block freed there may
    still be read by queued kernels), which would end the prefetch's overlap, so the two pools stay;
    with ``expandable_segments`` (set unless the user configured it) a pool's free pages go back
    to the device page by page when the other needs them (an allocator retry, counted in
    ``torch.cuda.memory_stats()["num_alloc_retries"]``).
    """
    backend = "cuda"
    budget_option = ("partition.memory_budget_bytes (default: 4/7 of 90% of the GPU's memory less its CUDA context, "
                     "workspaces and allocator pages: two allocation pools)")

    @classmethod
    def create(cls, num_workers: int, device_indices=None, **options) -> "CudaWorkerPool":
        """One worker per entry of ``device_indices`` (default: GPUs ``0..num_workers-1``)."""
        return cls(device_indices if device_indices is not None else range(num_workers), **options)

    @classmethod
    def options_from(cls, options) -> dict:
        """Download buffers are pinned unless the pinned policy is "off"."""
        return dict(pin_memory=options.pinned != "off")

    @classmethod
    def default_compile_layers(cls, device_indices=None) -> bool:
        """Compiled layers by default where inductor generates GPU code (``inductor_generates_gpu_code``)."""
        return inductor_generates_gpu_code(device_indices)

    @classmethod
    def memory_budget_bytes(cls, device_indices, options) -> int | None:
        """``gpu_budget_bytes`` of the smallest GPU: what the memory model assumes a worker may fill, less the
        share its two allocation pools cost."""
        indices = list(device_indices) if device_indices is not None else [0]
        return min(gpu_budget_bytes(torch.cuda.get_device_properties(i).total_memory,
                                    tuple(torch.cuda.get_device_capability(i))) for i in indices)

    def __init__(self, device_indices, timeout_s: float = 300.0, trace=None, max_in_flight: int = 2,
                 pin_memory: bool = True, fifo_transfers: bool = False,
                 stream_jitter_cycles: int = 0, seed: int = 0, host_buffer_cap_bytes: int = DEFAULT_CAP_BYTES):
        """``device_indices`` may repeat a GPU: several workers (each with its own streams) on one device."""
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA backend needs CUDA: use accelerator='cpu' for virtual CPU workers")
        self.expandable_segments_set = use_expandable_segments()
        super().__init__(CudaStreams(stream_jitter_cycles, seed), [torch.device("cuda", int(i)) for i in device_indices],
                         timeout_s=timeout_s,
                         trace=trace, max_in_flight=max_in_flight, pin_memory=pin_memory,
                         fifo_transfers=fifo_transfers, host_buffer_cap_bytes=host_buffer_cap_bytes)

    def on_lane_start(self, lane: Lane) -> None:
        super().on_lane_start(lane)
        torch.cuda.set_device(lane.worker.device)
