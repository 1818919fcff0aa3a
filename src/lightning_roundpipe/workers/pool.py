"""The worker pool: N stateless workers, each with an upload, a compute and a download queue.

Each queue is a :class:`Lane`: a host thread with its own list of pending tasks. A task runs
once every completion it depends on is set; its own completion is then set. The compute lane
runs its tasks strictly in submission order (so gradients accumulate in a fixed order); the two
transfer lanes pick the highest-priority task whose inputs are ready (lower number first), so an
activation the running stage waits for overtakes a queued weight prefetch.

What "running a task" means is the backend's business (:meth:`WorkerPool._execute`): the CPU
backend runs it on the lane thread (with optional injected delay, jitter and bandwidth cost);
the CUDA backend issues it on the lane's stream and records an event. The code that orders work
(the engine) is the same for both.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from typing import Any, Callable, Sequence

import torch

from ..tracing.records import TraceRecord, TraceRecorder
from .completions import Completion, PipelineTimeout, TaskLabel

QUEUES = ("upload", "compute", "download")


class _Task:
    __slots__ = ("fn", "deps", "done", "priority", "seq", "nbytes", "submitted", "always")

    def __init__(self, fn, deps, done, priority, seq, nbytes, always=False):
        self.always = always  # run even when a dependency failed (releases of memory)
        self.fn = fn
        self.deps = deps
        self.done = done
        self.priority = priority
        self.seq = seq
        self.nbytes = nbytes
        self.submitted = time.monotonic()

    def key(self):
        return (self.priority, self.seq)


class Lane:
    """One queue of one worker, served by its own thread."""

    def __init__(self, pool: "WorkerPool", worker: "Worker", queue: str):
        self.pool = pool
        self.worker = worker
        self.queue = queue
        # The compute lane always runs in submission order (fixed gradient accumulation order);
        # transfer lanes do too when the pool is asked for plain FIFO queues (no priorities).
        self.strict_order = queue == "compute" or pool.fifo_transfers
        self._pending: list[tuple[tuple[int, int], _Task]] = []
        self.busy = False
        # Woken only by what concerns this lane: a task submitted to it, a completion one of its
        # tasks waits for, shutdown. Shares the pool's lock.
        self.cond = threading.Condition(pool._lock)
        self.stream: Any = None  # set by the CUDA backend
        self._thread = threading.Thread(
            target=self._loop, name=f"roundpipe-w{worker.index}-{queue}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def submit(self, task: _Task) -> None:
        key = (0, task.seq) if self.strict_order else task.key()  # a strict lane ignores priorities
        with self.pool._lock:
            bisect.insort(self._pending, (key, task), key=lambda kt: kt[0])
            for d in task.deps:
                if not d.is_set():
                    if d.waiters is None:
                        d.waiters = []
                    d.waiters.append(self)
            self.cond.notify()

    def pending_count(self) -> int:
        return len(self._pending) + (1 if self.busy else 0)

    def describe_pending(self) -> list[str]:
        lines = []
        for _, task in self._pending:
            waiting = [str(d.label) for d in task.deps if not d.is_set()]
            lines.append(f"[{task.done.label}] waits for: {', '.join(waiting) or 'its turn'}")
        return lines

    # Called with the pool lock held. Returns (task, error) or (None, None).
    def _pick(self, now: float):
        for pos, (_, task) in enumerate(self._pending):
            failed = None if task.always else next((d for d in task.deps if d.failed()), None)
            if failed is not None:
                del self._pending[pos]
                return task, failed.error
            if all(d.is_set() for d in task.deps):
                del self._pending[pos]
                return task, None
            if now - task.submitted > self.pool.timeout_s:
                del self._pending[pos]
                waiting = next(d for d in task.deps if not d.is_set())
                return task, PipelineTimeout(
                    f"[{task.done.label}] timed out after {self.pool.timeout_s:g}s waiting for [{waiting.label}]"
                    f" (its event was never set)\n{self.pool._diagnose_locked()}"
                )
            if self.strict_order:
                break
        return None, None

    def _loop(self) -> None:
        self.pool._on_lane_start(self)
        cv = self.pool._cv
        while True:
            with self.cond:
                while True:
                    if self.pool._stopping:
                        return
                    task, error = self._pick(time.monotonic())
                    if task is not None:
                        self.busy = True
                        break
                    self.cond.wait(timeout=0.5)  # the timeout also lets _pick notice timed-out tasks
            try:
                if error is not None:
                    task.done.fail(error)
                else:
                    try:
                        self.pool._execute(self, task)
                    except BaseException as exc:  # the caller gets it, with the traceback
                        task.done.fail_from_exception(exc)
            finally:
                with cv:
                    self.busy = False
                    cv.notify_all()  # drain() waits for idle lanes


class Worker:
    """A stateless worker: three lanes and a device. Holds only what the running tasks hold."""

    def __init__(self, pool: "WorkerPool", index: int, device: torch.device):
        self.pool = pool
        self.index = index
        self.device = device
        self.lanes = {q: Lane(pool, self, q) for q in QUEUES}
        self._mem_lock = threading.Lock()
        self.resident_weight_bytes = 0
        self.peak_weight_bytes = 0

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
        done = Completion(label, self.pool)
        deps = [d for d in deps if d is not None]
        self.lanes[queue].submit(_Task(fn, deps, done, priority, next(self.pool._seq), nbytes, always))
        return done

    def compute(self, fn, deps, label: TaskLabel) -> Completion:
        return self.submit("compute", fn, deps, label)

    def upload(self, host_tensors_fn, dtypes, deps, label: TaskLabel, priority: int, nbytes: int = 0) -> Completion:
        """Copy host tensors to this worker (cast to ``dtypes``); the completion's value is the device list.

        ``host_tensors_fn`` is called when the task runs, so it may read the value of a completion
        the task depends on.
        """
        return self.submit(
            "upload", lambda: self.pool._copy_to_device(self, host_tensors_fn(), dtypes), deps, label, priority, nbytes
        )

    def download(self, device_tensors_fn, deps, label: TaskLabel, priority: int, nbytes: int = 0) -> Completion:
        """Copy device tensors (``None`` entries kept) to host memory; the completion's value is the host list."""
        return self.submit(
            "download", lambda: self.pool._copy_to_host(self, device_tensors_fn()), deps, label, priority, nbytes
        )

    def track_weights(self, delta_bytes: int) -> None:
        with self._mem_lock:
            self.resident_weight_bytes += delta_bytes
            self.peak_weight_bytes = max(self.peak_weight_bytes, self.resident_weight_bytes)


class WorkerPool:
    """Base of the backends. Subclasses define devices, copies and how a task is executed."""

    backend = "base"

    def __init__(self, devices: Sequence[torch.device], timeout_s: float = 300.0, trace: TraceRecorder | None = None,
                 fifo_transfers: bool = False):
        if len(devices) < 1:
            raise ValueError("a worker pool needs at least one worker")
        self.timeout_s = float(timeout_s)
        self.fifo_transfers = fifo_transfers
        self.trace = trace if trace is not None else TraceRecorder()
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)  # drain, shutdown and cancel wait or notify here
        self._seq = itertools.count()
        self._stopping = False
        self.workers = [Worker(self, i, torch.device(d)) for i, d in enumerate(devices)]
        self._started = False

    def __len__(self) -> int:
        return len(self.workers)

    def start(self) -> "WorkerPool":
        if not self._started:
            for w in self.workers:
                for lane in w.lanes.values():
                    lane.start()
            self._started = True
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._wake_all_locked()
        if self._started:
            for w in self.workers:
                for lane in w.lanes.values():
                    lane.join(timeout)
        self._started = False

    def lanes(self):
        for w in self.workers:
            yield from w.lanes.values()

    def idle(self) -> bool:
        with self._cv:
            return all(lane.pending_count() == 0 for lane in self.lanes())

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every queue is empty (after an error, failed tasks fail their dependants quickly)."""
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cv:
            while not all(lane.pending_count() == 0 for lane in self.lanes()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineTimeout(f"worker queues did not drain within {timeout:g}s\n{self._diagnose_locked()}")
                self._cv.wait(timeout=min(left, 0.5))
        self.synchronize()

    def cancel_pending(self, error: BaseException) -> None:
        """Fail every queued task with ``error`` (running ones finish); releases still run.

        Used after a timeout or an interrupt, when waiting for the queues to drain could take
        as long again. A release only drops references and updates the memory count, so it is
        safe to run here, and it keeps the per-worker memory accounting right.
        """
        with self._cv:
            for lane in self.lanes():
                pending, lane._pending = lane._pending, []
                for _, task in pending:
                    if task.always:
                        try:
                            task.done.set(task.fn())
                        except BaseException as exc:  # pragma: no cover - releases do not raise
                            task.done.fail_from_exception(exc)
                    else:
                        task.done.fail_from_exception(error)
            self._wake_all_locked()

    def _wake_all_locked(self) -> None:
        self._cv.notify_all()
        for lane in self.lanes():
            lane.cond.notify()

    def _on_completion(self, completion: Completion) -> None:
        """A completion was set or failed: wake the lanes with a task waiting for it."""
        with self._lock:
            waiters, completion.waiters = completion.waiters, None
            for lane in waiters or ():
                lane.cond.notify()

    def diagnose(self) -> str:
        with self._cv:
            return self._diagnose_locked()

    def _diagnose_locked(self) -> str:
        lines = ["pending tasks:"]
        for lane in self.lanes():
            for text in lane.describe_pending()[:4]:
                lines.append(f"  worker {lane.worker.index} {lane.queue}: {text}")
        return "\n".join(lines) if len(lines) > 1 else "no pending tasks"

    def peak_weight_bytes(self) -> list[int]:
        return [w.peak_weight_bytes for w in self.workers]

    def reset_peaks(self) -> None:
        for w in self.workers:
            with w._mem_lock:
                w.peak_weight_bytes = w.resident_weight_bytes

    # ------------------------------------------------------------------ backend hooks
    def _on_lane_start(self, lane: Lane) -> None:
        pass

    def _execute(self, lane: Lane, task: _Task) -> None:
        raise NotImplementedError  # each backend defines how a task runs

    def _copy_to_device(self, worker: Worker, tensors, dtypes, read_only=False):
        """Device copies of host ``tensors`` (cast to ``dtypes`` where given). ``read_only`` (one
        flag, or one per tensor): the engine will only read that tensor (parameters), so a backend
        whose device memory is host memory may share it."""
        raise NotImplementedError  # each backend defines its copies

    def _copy_to_host(self, worker: Worker, tensors):
        raise NotImplementedError  # each backend defines its copies

    def synchronize(self) -> None:
        pass

    def _record(self, lane: Lane, task: _Task, start: float, end: float) -> None:
        if self.trace.recording and task.done.label.kind != "release":
            lab = task.done.label
            self.trace.add(
                TraceRecord(lane.worker.index, lane.queue, lab.kind, lab.stage, lab.microbatch, task.nbytes, start, end, self.trace.step)
            )
