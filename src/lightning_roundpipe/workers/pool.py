"""The worker pool: N stateless workers, each with an upload, a compute and a download queue.

Each queue is a ``Lane``, a host thread running a task once every completion it depends on is
set: the compute lane in submission order (gradients accumulate in a fixed order), the transfer
lanes highest priority first, so an activation the running stage waits for overtakes a weight
prefetch. Running a task is the backend's business (``WorkerPool.execute``); lanes wait on
events, not polls; every wait is bounded by ``timeout_s`` and a timeout names the task really
stuck (``WorkerPool.blocker``). Details: docs/design.md, design notes, ``workers/pool.py``.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence

import torch

from ..schedule.graph_task import IN_ORDER_LANES, LANES, TaskKind
from ..tracing.records import TraceRecord, TraceRecorder
from ..host.compile_clock import COMPILE_CLOCK
from ..errors import PipelineTimeout
from .completions import Completion, TaskLabel
from .device_memory import DeviceMemory
from ..host.threads import keep_intra_op_threads, set_intra_op_threads

log = logging.getLogger("lightning_roundpipe")


class Task:
    """One queued unit of work of a lane: what to run, what it waits for, where its result goes.

    ``unready`` counts the dependencies not yet ready for the lane (each tells the lane when it
    is, see ``Lane``); ``error`` is a failed dependency's error the task will fail with."""

    __slots__ = ("fn", "deps", "done", "priority", "seq", "nbytes", "submitted", "always", "unready", "error", "state",
                 "step")

    def __init__(self, fn, deps, done, priority, seq, nbytes, always=False, step=0):
        self.always = always  # run even when a dependency failed (releases of memory)
        self.step = step  # the trace's step when submitted: a call's late tasks may run during the next call
        self.fn = fn
        self.deps = deps
        self.done = done
        self.priority = priority
        self.seq = seq
        self.nbytes = nbytes
        self.submitted = time.monotonic()
        self.unready = 0
        self.error: BaseException | None = None
        self.state = WAITING

    def key(self):
        """The lane's ordering key: priority, then submission order."""
        return (self.priority, self.seq)


WAITING, READY, GONE = "waiting", "ready", "gone"  # a task's states in its lane (GONE: run, timed out or cancelled)


@dataclass(frozen=True)
class LaneCounters:
    """What the pool's lanes did since the pool started (or ``reset_lane_counters``), summed over
    every lane: read with ``WorkerPool.lane_counters()``; subtract two readings for an interval.

    ``wakeups``: a lane's thread returned from its wait (woken by a task it can now run, by
    shutdown, or by the deadline of its oldest waiting task). ``looks``: a lane looked for a task
    to run (once per wake-up and once after each task). ``tasks_examined``: pending tasks those
    looks examined (one at most per look: lanes index their tasks by readiness instead of scanning
    the pending list). ``dependency_wakes``: dependencies that became ready and told their task
    (set, or their device work finished). ``device_notifications``: of those, device events whose
    completion the stream driver reported (no polling). ``tasks_run``: tasks the lanes ran (or
    failed with a dependency's error). ``bookkeeping_s``: host seconds spent in this
    bookkeeping under the pool lock (submits, notifications, looks), on whatever thread.
    """

    wakeups: int = 0
    looks: int = 0
    tasks_examined: int = 0
    dependency_wakes: int = 0
    device_notifications: int = 0
    tasks_run: int = 0
    bookkeeping_s: float = 0.0

    def __sub__(self, earlier: "LaneCounters") -> "LaneCounters":
        return LaneCounters(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))


class _Tally:
    """The mutable counts behind ``LaneCounters``, changed only under the pool lock."""

    __slots__ = tuple(f.name for f in fields(LaneCounters))

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        for f in fields(LaneCounters):
            setattr(self, f.name, f.default)

    def snapshot(self) -> LaneCounters:
        return LaneCounters(*(getattr(self, name) for name in self.__slots__))


class Lane:
    """One queue of one worker, served by its own thread.

    Nothing is scanned or polled: each task counts its dependencies that are not ready for the
    lane yet, and each such dependency holds the task (``Completion.waiters``, or a device-event
    notification from the stream driver when the dependency is issued but its device work
    unfinished). A dependency that becomes ready lowers the count; at zero the task is ready and
    the lane is woken only if it can now run it. A strict lane keeps every task in submission
    order and runs the first once it is ready; a priority lane keeps a heap of ready tasks. The
    lane's wait is bounded by the deadline of its oldest waiting task (a timeout names it).
    """

    def __init__(self, pool: "WorkerPool", worker: "Worker", queue: str):
        self.pool = pool
        self.worker = worker
        self.queue = queue
        # The compute lane always runs in submission order (fixed gradient accumulation order);
        # transfer lanes do too when the pool is asked for plain FIFO queues (no priorities).
        self.strict_order = queue in IN_ORDER_LANES or pool.fifo_transfers
        self._order: list[Task] = []  # strict lanes: every pending task, in submission order
        self._ready: list[tuple[int, int, Task]] = []  # priority lanes: heap of ready tasks
        self._waiting: dict[int, Task] = {}  # priority lanes: seq -> task not ready yet, oldest first
        self.busy = False
        self.running: Task | None = None  # the task this lane's thread is executing now
        # Woken only by what concerns this lane: a task it can now run, shutdown. Shares the pool's lock.
        self.cond = threading.Condition(pool._lock)
        self.stream: Any = None  # the stream backends give each lane its stream while they construct the pool
        self._thread = threading.Thread(
            target=self._loop, name=f"roundpipe-w{worker.index}-{queue}", daemon=True
        )

    def start(self) -> None:
        """Start the lane's thread."""
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the lane's thread to end."""
        self._thread.join(timeout)

    def alive(self) -> bool:
        """Whether the lane's thread still runs."""
        return self._thread.is_alive()

    def is_thread(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` is this lane's thread."""
        return thread is self._thread

    def submit(self, task: Task) -> None:
        """Queue a task; the lane runs it once its dependencies are ready (a strict lane in submission order)."""
        with self.pool._lock:
            t0 = time.perf_counter()
            for d in task.deps:
                self._track(task, d)
            if self.strict_order:
                bisect.insort(self._order, task, key=_seq_of)
            else:
                self._waiting[task.seq] = task
            self._check_ready(task)
            self.pool._tally.bookkeeping_s += time.perf_counter() - t0

    # ---------------------------------------------------------------- readiness (pool lock held)
    def _track(self, task: Task, d: Completion) -> None:
        """Count ``d`` against ``task`` until it is ready for this lane, and have it tell the task then."""
        if task.error is not None:
            return
        if not d.is_set():
            task.unready += 1
            if d.waiters is None:
                d.waiters = []
            d.waiters.append((self, task))
        elif d.failed():
            if not task.always:
                task.error = d.error
        elif not self.pool.ready_for(self, d):  # issued, its device work unfinished: the driver tells
            if self.pool.notify_when_device_done(d, lambda: self._device_done(task)):
                task.unready += 1

    def dependency_set(self, task: Task, d: Completion) -> None:
        """``d``, one of ``task``'s dependencies, was set or failed (``WorkerPool.on_completion``)."""
        if task.state is GONE:
            return
        self.pool._tally.dependency_wakes += 1
        task.unready -= 1
        self._track(task, d)  # counts it again while its device work runs
        self._check_ready(task)

    def _device_done(self, task: Task) -> None:
        with self.pool._lock:
            t0 = time.perf_counter()
            tally = self.pool._tally
            tally.device_notifications += 1
            if task.state is not GONE:
                tally.dependency_wakes += 1
                task.unready -= 1
                self._check_ready(task)
            tally.bookkeeping_s += time.perf_counter() - t0

    def _check_ready(self, task: Task) -> None:
        if task.state is not WAITING or (task.unready > 0 and task.error is None):
            return
        task.state = READY
        if self.strict_order:
            if self._order[0] is task:  # a ready task behind the first waits for it: no wake-up
                self.cond.notify()
        else:
            del self._waiting[task.seq]
            heapq.heappush(self._ready, (task.priority, task.seq, task))
            self.cond.notify()

    def take_all(self) -> list[Task]:
        """Remove every queued (not running) task, in submission order (``cancel_pending``)."""
        tasks = sorted(self._order + [t for _, _, t in self._ready] + list(self._waiting.values()), key=_seq_of)
        self._order, self._ready, self._waiting = [], [], {}
        for t in tasks:
            t.state = GONE
        return tasks

    def _queued(self) -> list[Task]:
        if self.strict_order:
            return list(self._order)
        return [t for _, _, t in sorted(self._ready, key=lambda e: e[:2])] + list(self._waiting.values())

    def pending_count(self) -> int:
        """Tasks queued or running."""
        return len(self._order) + len(self._ready) + len(self._waiting) + (1 if self.busy else 0)

    def describe_pending(self) -> list[str]:
        """The running and waiting tasks in words, for timeout messages."""
        lines = []
        if self.running is not None:
            since = time.monotonic() - self.running.done.started
            lines.append(f"[{self.running.done.label}] running for {since:.1f}s")
        for task in self._queued():
            waiting = [str(d.label) for d in task.deps if not self.pool.ready_for(self, d)]
            lines.append(f"[{task.done.label}] waits for: {', '.join(waiting) or 'its turn'}")
        return lines

    def first_waiting(self) -> Task | None:
        """The next task the lane would run, if any."""
        queued = self._queued()
        return queued[0] if queued else None

    # Called with the pool lock held. Returns (task, error, wait_s): a task to run (or to fail with
    # ``error``), else how long the lane may sleep before its oldest waiting task times out.
    def _next(self, now: float):
        tally = self.pool._tally
        tally.looks += 1
        if self.strict_order:
            head = self._order[0] if self._order else None
            if head is not None and head.state is READY:
                tally.tasks_examined += 1
                del self._order[0]
                return self._taken(head), head.error, 0.0
            oldest = head
        else:
            if self._ready:
                tally.tasks_examined += 1
                task = heapq.heappop(self._ready)[2]
                return self._taken(task), task.error, 0.0
            oldest = next(iter(self._waiting.values()), None)
        if oldest is None:
            return None, None, self.pool.timeout_s
        tally.tasks_examined += 1
        # A little after the timeout: a host wait for the same work, begun after the submit, times
        # out first and reports it from the caller's side (as the lanes' old 0.5 s look-again did).
        # Compile seconds since the submit do not count (``compile_clock``).
        left = (oldest.submitted + self.pool.timeout_s + min(0.5, self.pool.timeout_s / 4)
                + COMPILE_CLOCK.seconds_between(oldest.submitted, now) - now)
        if left > 0:
            return None, None, left
        if self.strict_order:
            del self._order[0]
        else:
            del self._waiting[oldest.seq]
        waiting = next((d for d in oldest.deps if not self.pool.ready_for(self, d)), None)
        what = f"[{waiting.label}]" if waiting is not None else "its dependencies"
        return self._taken(oldest), PipelineTimeout(
            f"[{oldest.done.label}] timed out after {self.pool.timeout_s:g}s waiting for {what}\n"
            f"{self.pool.diagnose_locked(waiting)}"
        ), 0.0

    @staticmethod
    def _taken(task: Task) -> Task:
        task.state = GONE
        return task

    def _loop(self) -> None:
        self.pool.on_lane_start(self)
        cv = self.pool._cv
        tally = self.pool._tally
        while True:
            with self.cond:
                while True:
                    if self.pool._stopping:
                        return
                    t0 = time.perf_counter()
                    task, error, wait_s = self._next(time.monotonic())
                    if task is not None:
                        self.busy = True
                        self.running = task
                        task.done.started = time.monotonic()
                        tally.tasks_run += 1
                        tally.bookkeeping_s += time.perf_counter() - t0
                        break
                    tally.bookkeeping_s += time.perf_counter() - t0
                    self.cond.wait(timeout=wait_s)
                    tally.wakeups += 1
            try:
                if error is not None:
                    task.done.fail(error)
                else:
                    try:
                        self.pool.execute(self, task)
                    except BaseException as exc:  # the caller gets it, with the traceback
                        task.done.fail_from_exception(exc)
            finally:
                with cv:
                    self.busy = False
                    self.running = None
                    cv.notify_all()  # drain() waits for idle lanes


def _seq_of(task: Task) -> int:
    return task.seq


class Worker:
    """A stateless worker: three lanes and a device. Holds only what the running tasks hold."""

    def __init__(self, pool: "WorkerPool", index: int, device: torch.device):
        self.pool = pool
        self.index = index
        self.device = device
        self.lanes = {q: Lane(pool, self, q) for q in LANES}
        self.memory = DeviceMemory(index)  # what this worker holds on its device (device_memory.py)

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
        self.lanes[queue].submit(Task(fn, deps, done, priority, next(self.pool._seq), nbytes, always,
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
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)  # drain, shutdown and cancel wait or notify here
        self._seq = itertools.count()
        self._stopping = False
        self._tally = _Tally()  # what the lanes did (``lane_counters``), changed under the lock
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
        with self._cv:
            self._stopping = True
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
        with self._cv:
            while not all(lane.pending_count() == 0 for lane in self.lanes()):
                left = deadline + COMPILE_CLOCK.seconds_between(deadline - timeout) - time.monotonic()
                if left <= 0:
                    raise PipelineTimeout(f"worker queues did not drain within {timeout:g}s\n{self.diagnose_locked()}")
                self._cv.wait(timeout=min(left, 0.5))
        self.synchronize(max(0.0, deadline - time.monotonic()))

    def cancel_pending(self, error: BaseException) -> None:
        """Fail every queued task with ``error`` (running ones finish); releases still run.

        Used after a timeout or an interrupt, when waiting for the queues to drain could take
        as long again. A release only drops references and updates the memory count, and it keeps
        the per-worker memory accounting right; it runs once the device work it frees memory
        under has finished (``run_cancelled_release``: at once here, later on the stream backends).
        """
        with self._cv:
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

    def run_cancelled_release(self, task: Task) -> None:
        """Run a release ``cancel_pending`` took from its lane (no device here: now)."""
        try:
            task.done.set(task.fn())
        except BaseException as exc:  # pragma: no cover - releases do not raise
            task.done.fail_from_exception(exc)

    def _wake_all_locked(self) -> None:
        self._cv.notify_all()
        for lane in self.lanes():
            lane.cond.notify()

    def on_completion(self, completion: Completion) -> None:
        """A completion was set or failed: tell the tasks waiting for it (their lanes wake only
        for a task they can now run)."""
        with self._lock:
            t0 = time.perf_counter()
            waiters, completion.waiters = completion.waiters, None
            for lane, task in waiters or ():
                lane.dependency_set(task, completion)
            self._tally.bookkeeping_s += time.perf_counter() - t0

    def lane_counters(self) -> LaneCounters:
        """What the lanes did since the pool started or ``reset_lane_counters`` (see ``LaneCounters``):
        wake-ups, looks, tasks examined and run, host seconds of lane bookkeeping."""
        with self._lock:
            return self._tally.snapshot()

    def reset_lane_counters(self) -> None:
        """Start ``lane_counters`` afresh from zero."""
        with self._lock:
            self._tally.clear()  # in place: each lane's loop holds it

    def diagnose(self, waited: Completion | None = None) -> str:
        """What every lane runs and waits for (and what ``waited`` depends on), for timeout messages."""
        with self._cv:
            return self.diagnose_locked(waited)

    def diagnose_locked(self, waited: Completion | None = None) -> str:
        """What is stuck (when ``waited`` is given), then what each lane runs and holds."""
        lines = []
        if waited is not None:
            lines.append(f"stuck: {self.blocker(waited)}")
        lines.append("lanes:")
        for lane in self.lanes():
            for text in lane.describe_pending()[:4]:
                lines.append(f"  worker {lane.worker.index} {lane.queue}: {text}")
        if len(lines) == (2 if waited is not None else 1):
            lines.append("  every lane is idle")
        return "\n".join(lines)

    def blocker(self, waited: Completion) -> str:
        """The task a wait for ``waited`` really waits on: follow unfinished dependencies (and, in an
        in-order lane, the task ahead) down to a running task or an event that nothing will set."""
        seen = set()
        c = waited
        while id(c) not in seen:
            seen.add(id(c))
            if c.is_set() and (c.device_event is None or c.device_event.query()):
                return f"[{c.label}] is done"
            if c.started:
                since = time.monotonic() - c.started
                state = "running" if not c.is_set() else "issued, its device work unfinished"
                return f"[{c.label}] {state} for {since:.1f}s"
            dep = next((d for d in c.deps if not d.is_set() or (d.device_event is not None and not d.device_event.query())),
                       None)
            if dep is not None:
                c = dep
                continue
            lane = self._lane_of(c)
            if lane is None:
                return f"[{c.label}] (set by the host, not by a worker task) was never set"
            if lane.running is not None:
                c = lane.running.done
                continue
            ahead = lane.first_waiting()
            if ahead is not None and ahead.done is not c and lane.strict_order:
                c = ahead.done
                continue
            return f"[{c.label}] is ready and waits for its lane"
        return f"[{c.label}] (dependency cycle)"

    def _lane_of(self, c: Completion) -> Lane | None:
        lab = c.label
        if 0 <= lab.worker < len(self.workers) and lab.queue in LANES:
            return self.workers[lab.worker].lanes[lab.queue]
        return None

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

    def execute(self, lane: Lane, task: Task) -> None:
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

    def record(self, lane: Lane, task: Task, start: float, end: float) -> None:
        """Put the task on the timeline when one is recorded (releases are left out)."""
        if self.trace.recording and task.done.label.kind != TaskKind.RELEASE:
            lab = task.done.label
            self.trace.add(
                TraceRecord(lane.worker.index, lane.queue, lab.kind, lab.stage, lab.microbatch, task.nbytes, start, end, task.step)
            )
