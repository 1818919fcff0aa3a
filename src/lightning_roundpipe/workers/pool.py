"""The worker pool: N stateless workers, each with an upload, a compute and a download lane.

``WorkerPool`` is the base of the backends: it owns the workers and their lanes' threads
(``completions.py``), starts, drains, cancels and shuts them down, and declares the hooks a backend
defines (devices, copies, how a task runs). A ``Worker`` submits tasks to its lanes and keeps a
``DeviceMemory`` ledger of what it holds on its device. Details: docs/design.md, design notes,
``workers/pool.py``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch

from ..schedule.graph_task import LANES, TaskKind
from ..tracing.records import TraceRecord, TraceRecorder
from ..host.compile_clock import COMPILE_CLOCK
from ..errors import PipelineTimeout
from .completions import Completion, Lane, TaskLabel, WorkOrder
from .device_memory import WorkerOutOfMemoryError
from .lane_reports import LaneCounters, LaneTally, describe_lanes
from ..host.threads import keep_intra_op_threads, set_intra_op_threads

log = logging.getLogger("lightning_roundpipe")


class Worker:
    """A stateless worker: three lanes and a device. Holds only what the running tasks hold."""

    def __init__(self, pool: "WorkerPool", index: int, device: torch.device):
        self.pool = pool
        self.index = index
        self.device = device
        self.lanes = {q: Lane(pool, self, q) for q in LANES}
        self.memory = DeviceMemory(index)  # what this worker holds on its device (below)

    @property
    def peak_weight_bytes(self) -> int:
        """The most weight bytes this worker held at once."""
        return self.memory.peak_weight_bytes

    def submit(
        self,
        queue: str,
        fn: Callable[[], Any],
        deps: Sequence[Completion],
        label: TaskLabel,
        priority: int = 0,
        nbytes: int = 0,
        always: bool = False,
    ) -> Completion:
        """Queue ``fn`` on one of this worker's lanes, to run once every completion in ``deps`` is set."""
        deps = [d for d in deps if d is not None]
        done = Completion(label, self.pool, tuple(deps))
        self.lanes[queue].submit(WorkOrder(fn, deps, done, priority, next(self.pool._seq), nbytes, always,
                                      self.pool.trace.step))
        return done

    def compute(self, fn, deps, label: TaskLabel) -> Completion:
        """Submit ``fn`` to the compute lane after ``deps``."""
        return self.submit("compute", fn, deps, label)

    def track_weights(self, delta_bytes: int) -> None:
        """Stage weights uploaded (or released, ``delta_bytes < 0``) by the task running on this
        thread; over the worker's memory cap this raises ``WorkerOutOfMemoryError``."""
        self.memory.track_weights(delta_bytes, self.running_label())

    def running_label(self) -> TaskLabel | None:
        """The label of the task this worker's lane runs on the calling thread (None off its lanes)."""
        me = threading.current_thread()
        lane = next((l for l in self.lanes.values() if l.is_thread(me)), None)
        return lane.running.done.label if lane is not None and lane.running is not None else None


class DeviceMemory:
    """One worker's ledger of device bytes: weights, tallied tensors, the peak, an optional cap."""

    def __init__(self, worker: int, cap_bytes: int | None = None) -> None:
        self.worker = worker
        self.cap_bytes = cap_bytes
        self._lock = threading.Lock()
        self.weight_bytes = 0
        self.tensor_bytes = 0
        self.peak_bytes = 0
        self.peak_weight_bytes = 0
        self.peak_task: TaskLabel | None = None  # the task that allocated the peak byte
        self._storages: dict[int, int] = {}  # id of a live storage -> its bytes

    @property
    def held_bytes(self) -> int:
        """Bytes the worker holds now: weights and tensors."""
        return self.weight_bytes + self.tensor_bytes

    def _over_cap(self, asked: int, before: int) -> bool:
        return self.cap_bytes is not None and asked > 0 and before + asked > self.cap_bytes

    def _error(self, label: TaskLabel | None, asked: int, before: int, weights_before: int):
        label = label or TaskLabel("unknown", worker=self.worker)
        return WorkerOutOfMemoryError(label, asked, before, weights_before, self.cap_bytes)

    def track_weights(self, delta: int, label: TaskLabel | None = None) -> None:
        """Weights uploaded (``delta > 0``) or released. Over the cap this raises, with the bytes
        counted (the stage's release takes them off again) but not taken as a peak."""
        with self._lock:
            before, weights_before = self.held_bytes, self.weight_bytes
            self.weight_bytes += delta
            over = self._over_cap(delta, before)
            if not over:
                self.peak_weight_bytes = max(self.peak_weight_bytes, self.weight_bytes)
                self._new_peak(label)
        if over:
            raise self._error(label, delta, before, weights_before)

    def hold(self, storage: torch.UntypedStorage, label: TaskLabel | None = None) -> None:
        """Count a storage a task created until it dies. One that would take the worker over the
        cap raises instead and is never counted: as on a GPU, the allocation did not happen (the
        tally drops the tensor as the error leaves the operator)."""
        nbytes = storage.nbytes()
        key = id(storage)
        if nbytes == 0:
            return
        with self._lock:
            if key in self._storages:
                return
            before, weights = self.held_bytes, self.weight_bytes
            if self._over_cap(nbytes, before):
                raise self._error(label, nbytes, before, weights)
            self._storages[key] = nbytes
            self.tensor_bytes += nbytes
            self._new_peak(label)
        weakref.finalize(storage, self._free, key)

    def _new_peak(self, label: TaskLabel | None) -> None:
        if self.held_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_task = self.held_bytes, label

    def _free(self, key: int) -> None:
        with self._lock:
            self.tensor_bytes -= self._storages.pop(key, 0)

    def reset_peak(self) -> None:
        """Start measuring the peaks again from what is held now."""
        with self._lock:
            self.peak_bytes, self.peak_task = self.held_bytes, None
            self.peak_weight_bytes = self.weight_bytes


class WorkerPool:
    """Base of the backends. Subclasses define devices, copies and how a task is executed."""

    backend = "base"
    # What a backend declares about itself, read before its pool exists (by the runtime's planner):
    keeps_graphs_across_workers = False  # its workers share memory, so recompute="never" can keep forward graphs
    pins_uploads = True  # the runtime pins the host tensors uploads read (``pin_uploads``)
    planner_device = "cuda"  # how the plan keeper prices recompute="auto": "cpu" (workers share the host's memory) or "cuda"
    assumed_link_bytes_per_s: float | None = 25e9  # the link before anything is measured (PCIe 4.0 x16); None: memory copies
    assumed_flops_per_s = 1e14  # the compute rate the first plan assumes (a GPU's order of magnitude)
    microbatch_overhead_s = 0.0  # host cost of one more microbatch of a stage besides its compute (GPUs: not measured)
    budget_option = "cpu_memory_cap_bytes"  # the option ``memory_budget_bytes`` reads, named in the planner's advice

    @classmethod
    def create(cls, num_workers: int, device_indices=None, **options) -> "WorkerPool":
        """A pool of ``num_workers`` workers (``device_indices``: only backends with real devices read them)."""
        return cls(num_workers, **options)

    @classmethod
    def options_from(cls, options) -> dict:
        """This backend's own constructor options taken from the user's ``RuntimeOptions`` (none by default)."""
        return {}

    @classmethod
    def default_compile_layers(cls, device_indices=None) -> bool:
        """Whether ``compile_layers=None`` compiles layers on this backend's ``device_indices``: no
        (eager; the CPU and fake-stream backends keep their tests and benchmarks on the eager path)."""
        return False

    @classmethod
    def memory_budget_bytes(cls, device_indices, options) -> int | None:
        """Per-worker budget of the partitioner and of ``recompute="auto"`` when the user set none."""
        return options.cpu_memory_cap_bytes

    def __init__(self, devices: Sequence[torch.device], timeout_s: float = 300.0, trace: TraceRecorder | None = None,
                 fifo_transfers: bool = False):
        if len(devices) < 1:
            raise ValueError("a worker pool needs at least one worker")
        # The caller's thread keeps its intra-op count (host/threads.py): the lanes and stream executors
        # started from here set theirs, and the caller's loss must not run on a lane's one thread.
        self.caller_threads = keep_intra_op_threads()
        self.timeout_s = float(timeout_s)
        self.fifo_transfers = fifo_transfers
        self.trace = trace if trace is not None else TraceRecorder()
        self.lock = threading.RLock()
        self.lane_idle = threading.Condition(self.lock)  # a lane went idle (drain waits); shutdown and cancel notify
        self._seq = itertools.count()
        self.stopping = False
        self.tally = LaneTally()  # what the lanes did (``lane_counters``), changed under the lock
        self.workers = [Worker(self, i, torch.device(d)) for i, d in enumerate(devices)]
        self._started = False

    def __len__(self) -> int:
        return len(self.workers)

    def start(self) -> "WorkerPool":
        """Start every lane's thread (once); returns the pool."""
        if not self._started:
            for w in self.workers:
                for lane in w.lanes.values():
                    lane.start()
            self._started = True
        return self

    def shutdown(self, timeout: float = 1.0) -> list[str]:
        """Stop every lane; wait at most ``timeout`` seconds in all (not per lane).

        Idle lanes stop at once. A lane inside a task stops when the task returns: after a
        timeout that task may be hung, and no wait here could end it, so shutdown returns after
        ``timeout`` and names the lanes still running (daemon threads that end with their task).
        """
        with self.lane_idle:
            self.stopping = True
            self._wake_all_locked()
        still: list[str] = []
        deadline = time.monotonic() + timeout
        if self._started:
            for lane in self.lanes():
                lane.join(max(0.0, deadline - time.monotonic()))
            still = [f"worker {lane.worker.index} {lane.queue}" + (f" in [{lane.running.done.label}]" if lane.running else "")
                     for lane in self.lanes() if lane.alive()]
        self._started = False
        self.on_shutdown(max(0.0, deadline - time.monotonic()))
        if still:
            log.warning("worker lanes still inside a task after shutdown (they end when it returns): %s", "; ".join(still))
        return still

    def lanes(self):
        """Every lane of every worker."""
        for w in self.workers:
            yield from w.lanes.values()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every queue is empty (after an error, failed tasks fail their dependants quickly)."""
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self.lane_idle:
            while not all(lane.pending_count() == 0 for lane in self.lanes()):
                left = deadline + COMPILE_CLOCK.seconds_between(deadline - timeout) - time.monotonic()
                if left <= 0:
                    raise PipelineTimeout(f"worker queues did not drain within {timeout:g}s\n{self.diagnose_locked()}")
                self.lane_idle.wait(timeout=min(left, 0.5))
        self.synchronize(max(0.0, deadline - time.monotonic()))

    def cancel_pending(self, error: BaseException) -> None:
        """Fail every queued task with ``error`` (running ones finish); releases still run.

        Used after a timeout or an interrupt, when waiting for the queues to drain could take
        as long again. A release only drops references and updates the memory count, and it keeps
        the per-worker memory accounting right; it runs once the device work it frees memory
        under has finished (``run_cancelled_release``: at once here, later on the stream backends).
        """
        with self.lane_idle:
            releases = []
            for lane in self.lanes():
                for task in lane.take_all():
                    if task.always:
                        releases.append(task)
                    else:
                        task.done.fail_from_exception(error)
            self._wake_all_locked()
        for task in releases:  # outside the lock: a backend may wait for the device here
            self.run_cancelled_release(task)

    def run_cancelled_release(self, task: WorkOrder) -> None:
        """Run a release ``cancel_pending`` took from its lane (no device here: now)."""
        try:
            task.done.set(task.fn())
        except BaseException as exc:  # pragma: no cover - releases do not raise
            task.done.fail_from_exception(exc)

    def _wake_all_locked(self) -> None:
        self.lane_idle.notify_all()
        for lane in self.lanes():
            lane.cond.notify()

    def on_completion(self, completion: Completion) -> None:
        """A completion was set or failed: tell the tasks waiting for it (their lanes wake only
        for a task they can now run)."""
        with self.lock:
            t0 = time.perf_counter()
            waiters, completion.waiters = completion.waiters, None
            for lane, task in waiters or ():
                lane.dependency_set(task, completion)
            self.tally.bookkeeping_s += time.perf_counter() - t0

    def lane_counters(self) -> LaneCounters:
        """What the lanes did since the pool started or ``reset_lane_counters`` (see ``LaneCounters``):
        wake-ups, looks, tasks examined and run, host seconds of lane bookkeeping."""
        with self.lock:
            return self.tally.snapshot()

    def reset_lane_counters(self) -> None:
        """Start ``lane_counters`` afresh from zero."""
        with self.lock:
            self.tally.clear()  # in place: each lane's loop holds it

    def diagnose(self, waited: Completion | None = None) -> str:
        """What every lane runs and waits for (and what ``waited`` depends on), for timeout messages."""
        with self.lane_idle:
            return self.diagnose_locked(waited)

    def diagnose_locked(self, waited: Completion | None = None) -> str:
        """``diagnose`` with the pool lock held (``lane_reports.describe_lanes``)."""
        return describe_lanes(self, waited)

    def ready_for(self, lane: Lane, dep: Completion) -> bool:
        """Whether ``dep`` no longer holds back a task of ``lane`` (the stream backends also ask that
        its device work be finished before a transfer or a release is issued)."""
        return dep.is_set()

    def task_text(self, thread: threading.Thread) -> str:
        """Names the task a lane of this pool runs on ``thread`` (for errors raised inside a task)."""
        for lane in self.lanes():
            if lane.is_thread(thread):
                running = lane.running
                return f"task [{running.done.label}]" if running is not None else f"worker {lane.worker.index} {lane.queue} lane"
        return f"thread {thread.name}"

    def threads_alive(self) -> list[str]:
        """Names of the lane threads still running."""
        return [f"roundpipe-w{lane.worker.index}-{lane.queue}" for lane in self.lanes() if lane.alive()]

    def peak_weight_bytes(self) -> list[int]:
        """The most weight bytes each worker held at once."""
        return [w.peak_weight_bytes for w in self.workers]

    def peak_device_bytes(self) -> list[int]:
        """Per worker, the most device bytes held at once since the last reset: weights and, where
        the backend measures them (the CPU backend's ``measure_memory``), every tensor its tasks
        created (see ``device_memory.py``)."""
        return [w.memory.peak_bytes for w in self.workers]

    def held_device_bytes(self) -> list[int]:
        """Per worker, the device bytes held now (0 everywhere once a step's tasks are gone)."""
        return [w.memory.held_bytes for w in self.workers]

    def reset_peak_device_bytes(self) -> None:
        """Start the peaks of ``peak_device_bytes`` and ``peak_weight_bytes`` afresh from what is held now."""
        for w in self.workers:
            w.memory.reset_peak()

    def pinned_host_bytes(self) -> int:
        """Host bytes this pool holds pinned (page-locked) now; none on a backend without pinned memory."""
        return 0

    def step_peak_device_bytes(self) -> list[int]:
        """Per worker, the most device bytes held since ``reset_step_peaks``: ``peak_device_bytes``
        here; a backend whose allocator knows better (CUDA) reports that."""
        return self.peak_device_bytes()

    def reset_step_peaks(self) -> None:
        """Start ``step_peak_device_bytes`` afresh (called after each logged step)."""
        self.reset_peak_device_bytes()

    # ------------------------------------------------------------------ backend hooks
    def notify_when_device_done(self, dep: Completion, fn: Callable[[], None]) -> bool:
        """Have ``fn`` called (on another thread) once the device work of ``dep``, set already, has
        finished; False, and no call, when it has finished now. Only the stream backends ever have
        set completions whose device work is unfinished (``ready_for``)."""
        return False

    def lane_threads(self, lane: Lane) -> int:
        """Torch intra-op threads of ``lane``'s thread, set explicitly as it starts (a new thread
        otherwise inherits whatever the last thread set). 1 here: the stream backends' lanes only
        launch kernels and copies, and the fake streams' executors run with ``FakeStreams.threads``
        (1); the CPU backend gives its compute lanes ``threads_per_worker``."""
        return 1

    def on_lane_start(self, lane: Lane) -> None:
        """Called on each lane's thread as it starts: sets its intra-op threads (``lane_threads``);
        a backend also sets the device here."""
        set_intra_op_threads(self.lane_threads(lane))

    def on_shutdown(self, timeout: float) -> None:
        """Stop what the backend runs besides the lanes (stream executors)."""

    def finish_step(self) -> None:
        """Turn the device timings of the tasks issued so far into trace records (stream backends
        read their timing events once per step, here; the CPU backend records as it runs)."""

    def execute(self, lane: Lane, task: WorkOrder) -> None:
        """Run ``task`` on ``lane``'s thread and set its completion: each backend's own."""
        raise NotImplementedError  # each backend defines how a task runs

    def copy_to_device(self, worker: Worker, tensors, dtypes, read_only=False):
        """Device copies of host ``tensors`` (cast to ``dtypes`` where given). ``read_only`` (one
        flag, or one per tensor): the engine will only read that tensor (parameters), so a backend
        whose device memory is host memory may share it."""
        raise NotImplementedError  # each backend defines its copies

    def copy_to_host(self, worker: Worker, tensors, reusable: bool = False):
        """Host copies of device ``tensors``. ``reusable``: the engine will hand them back with
        ``release_host`` once nothing reads them, so a backend may lend reused buffers."""
        raise NotImplementedError  # each backend defines its copies

    def release_host(self, tensors) -> None:
        """Take back host tensors from ``copy_to_host(..., reusable=True)``; others are ignored."""

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` until the devices finished everything issued (nothing on the CPU)."""
        pass

    def record(self, lane: Lane, task: WorkOrder, start: float, end: float) -> None:
        """Put the task on the timeline when one is recorded (releases are left out)."""
        if self.trace.recording and task.done.label.kind != TaskKind.RELEASE:
            lab = task.done.label
            self.trace.add(
                TraceRecord(lane.worker.index, lane.queue, lab.kind, lab.stage, lab.microbatch, task.nbytes, start, end, task.step)
            )
