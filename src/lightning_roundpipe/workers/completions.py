"""Completions and lanes: the events that order a worker's work, and the lanes that run it in that order.

A ``Completion`` is set when its task's work is *issued*: on the CPU backend that means done; on
the stream backends it means enqueued on a stream, with a device event recorded after it, so
another lane orders itself after it without blocking the host (``Completion.wait`` waits for the
data). A ``Lane`` is one of a worker's queues, a host thread running a ``WorkOrder`` once every
completion it depends on is set: the compute lane in submission order, transfer lanes highest
priority first. Lanes wait on notifications, never polls; every wait has a timeout (compile seconds
do not count) whose error names the task. Details: docs/design.md, design notes, ``workers/pool.py``.
"""

from __future__ import annotations

import bisect
import heapq
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from ..errors import PipelineError, PipelineTimeout, WorkerError
from ..host.compile_clock import COMPILE_CLOCK, wait_excluding_compiles
from ..schedule.graph_task import IN_ORDER_LANES
from .task_errors import forget_frames, is_out_of_memory, worker_error

# ``Worker`` and ``WorkerPool`` (pool.py) are named only in annotations: pool.py imports this module.


@dataclass(frozen=True)
class TaskLabel:
    """What a task is: its kind, stage, microbatch and worker, as errors and traces name it."""
    kind: str  # a TaskKind (schedule/graph_task.py); host-side labels name theirs ("optim", "undo", "input", ...)
    stage: str = ""  # "F0", "B2", ... or "" for tasks not tied to a stage
    microbatch: int = -1
    worker: int = -1
    queue: str = ""

    def __str__(self) -> str:
        parts = [self.kind]
        if self.stage:
            parts.append(f"stage {self.stage}")
        if self.microbatch >= 0:
            parts.append(f"microbatch {self.microbatch}")
        if self.worker >= 0:
            parts.append(f"worker {self.worker}")
        if self.queue:
            parts.append(f"{self.queue} queue")
        return ", ".join(parts)


class Deferred:
    """A value a stream executor will produce: the fake-stream backend's stand-in for device tensors
    that exist at issue time on CUDA. ``result`` waits (bounded) for it and re-raises its error."""

    __slots__ = ("label", "timeout_s", "_ready", "_value", "_error")

    def __init__(self, label: TaskLabel, timeout_s: float):
        self.label = label
        self.timeout_s = timeout_s
        self._ready = threading.Event()
        self._value: Any = None
        self._error: PipelineError | None = None

    def resolve(self, value: Any) -> None:
        """Hand over the value and wake ``result``."""
        self._value = value
        self._ready.set()

    def fail(self, exc: BaseException) -> None:
        """Hand over the error ``result`` re-raises (wrapped as a worker error)."""
        self._error = exc if isinstance(exc, PipelineError) else worker_error(self.label, exc)
        self._ready.set()

    def failed(self) -> PipelineError | None:
        """The work's error if it has run and failed (never waits)."""
        return self._error if self._ready.is_set() else None

    def result(self) -> Any:
        """The value, waiting at most ``timeout_s``; re-raises the work's error."""
        if not wait_excluding_compiles(self._ready.wait, self.timeout_s):
            raise PipelineTimeout(f"the work of [{self.label}] did not run on its stream within {self.timeout_s:g}s")
        if self._error is not None:
            raise self._error
        return self._value


def _device_pending(c: "Completion") -> bool:
    return c.device_event is not None and not c.device_event.query()


class Completion:
    """Set once when a task has issued its work; may instead fail with an error.

    ``deps`` and ``started`` (monotonic time its lane began it, 0 before) let a timeout name the
    task that is really stuck rather than the one waited for (see ``lane_reports.blocker``).
    """

    __slots__ = ("label", "_flag", "error", "device_event", "_notifier", "waiters", "_value", "deps", "started")

    def __init__(self, label: TaskLabel, notifier: Any = None, deps: tuple = ()):
        self.label = label
        self._flag = threading.Event()
        self.error: PipelineError | None = None
        # Recorded on the task's stream after its work (stream backends only): waited for on the
        # device by dependants, and on the host by ``wait``.
        self.device_event: Any = None
        self.deps = deps
        self.started = 0.0
        # The pool whose lanes may wait for this completion: told when it is set, it wakes the
        # lanes that registered in ``waiters`` (only those: no thundering herd of every lane).
        self._notifier = notifier
        self.waiters: list | None = None
        self._value: Any = None  # what the task produced (device tensors, host tensors, ...)

    @property
    def value(self) -> Any:
        """The task's value (waits for a deferred one)."""
        v = self._value
        return v.result() if isinstance(v, Deferred) else v

    def raw_value(self) -> Any:
        """The value without waiting: on the fake streams a ``Deferred`` the executor fills
        (holding it keeps what it will hold alive)."""
        return self._value

    @classmethod
    def done(cls, label: TaskLabel, value: Any = None) -> "Completion":
        """A completion already set to ``value``."""
        c = cls(label)
        c._value = value
        c._flag.set()
        return c

    def is_set(self) -> bool:
        """Whether the task finished (or failed)."""
        return self._flag.is_set()

    def failed(self) -> bool:
        """Whether the task failed."""
        return self.error is not None

    def _notify(self) -> None:
        if self._notifier is not None:
            self._notifier.on_completion(self)

    def drop_value(self) -> None:
        """Forget the task's value once every reader has read it: device tensors a completion
        keeps would otherwise stay allocated as long as the step's bookkeeping lives."""
        self._value = None

    def set(self, value: Any = None) -> None:
        """Mark the task done with ``value`` and wake what waits for it."""
        self._value = value
        # Dependencies only explain a wait on an unfinished task; kept after, they would chain
        # every completion (and the tensors it holds) back to the first step through the history.
        # On a stream backend a set completion's device work may still be queued behind a
        # dependency's: those stay, so that a timeout can still name the stuck task.
        self.deps = tuple(d for d in self.deps if not d.is_set() or _device_pending(d))
        self._flag.set()
        self._notify()

    def fail(self, error: PipelineError) -> None:
        """Mark the task failed with ``error`` and wake what waits for it."""
        self.error = error
        self.deps = ()
        self._flag.set()
        self._notify()

    def fail_from_exception(self, exc: BaseException) -> None:
        """Fail with ``exc`` turned into the pipeline error that names this task."""
        if isinstance(exc, WorkerError) and is_out_of_memory(exc):
            # Out of (capped) device memory: keep the worker's traceback as text, not its frames,
            # whose locals would keep the failed task's tensors allocated as long as the error lives.
            exc.worker_traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            forget_frames(exc)
        self.fail(exc if isinstance(exc, PipelineError) else worker_error(self.label, exc))

    def wait(self, timeout: float, waiter: str = "the caller", diagnose=None) -> Any:
        """Block until set and, on a stream backend, its device work finished; raise its error or a
        timeout naming it. ``diagnose(self)`` returns text naming what is stuck."""
        deadline = time.monotonic() + timeout
        if not wait_excluding_compiles(self._flag.wait, timeout):  # compile seconds do not count
            extra = f"\n{diagnose(self)}" if diagnose is not None else ""
            raise PipelineTimeout(
                f"{waiter} timed out after {timeout:g}s waiting for [{self.label}] to complete{extra}"
            )
        if self.error is not None:
            raise self.error
        deadline += COMPILE_CLOCK.seconds_between(deadline - timeout)
        event = self.device_event
        try:
            landed = event is None or event.wait(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # a device error (a device-side assert): name the task waited for
            raise worker_error(self.label, exc) from exc
        if not landed:
            extra = f"\n{diagnose(self)}" if diagnose is not None else ""
            raise PipelineTimeout(
                f"{waiter} timed out after {timeout:g}s waiting for the device work of [{self.label}] to finish{extra}"
            )
        self.deps = ()  # all of its work is done: nothing to explain any more
        return self.value


class WorkOrder:
    """What a worker runs: one queued unit of work of a lane, what it waits for, where its result goes.

    (The plan's ``DispatchedStage`` is a stage given to a worker; the lowering's ``GraphTask`` is
    one node of the step's task graph; a ``WorkOrder`` is the closure a lane runs for it.)

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
        self._order: list[WorkOrder] = []  # strict lanes: every pending task, in submission order
        self._ready: list[tuple[int, int, WorkOrder]] = []  # priority lanes: heap of ready tasks
        self._waiting: dict[int, WorkOrder] = {}  # priority lanes: seq -> task not ready yet, oldest first
        self.busy = False
        self.running: WorkOrder | None = None  # the task this lane's thread is executing now
        # Woken only by what concerns this lane: a task it can now run, shutdown. Shares the pool's lock.
        self.cond = threading.Condition(pool.lock)
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

    def submit(self, task: WorkOrder) -> None:
        """Queue a task; the lane runs it once its dependencies are ready (a strict lane in submission order)."""
        with self.pool.lock:
            t0 = time.perf_counter()
            for d in task.deps:
                self._track(task, d)
            if self.strict_order:
                bisect.insort(self._order, task, key=_seq_of)
            else:
                self._waiting[task.seq] = task
            self._check_ready(task)
            self.pool.tally.bookkeeping_s += time.perf_counter() - t0

    # ---------------------------------------------------------------- readiness (pool lock held)
    def _track(self, task: WorkOrder, d: Completion) -> None:
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

    def dependency_set(self, task: WorkOrder, d: Completion) -> None:
        """``d``, one of ``task``'s dependencies, was set or failed (``WorkerPool.on_completion``)."""
        if task.state is GONE:
            return
        self.pool.tally.dependency_wakes += 1
        task.unready -= 1
        self._track(task, d)  # counts it again while its device work runs
        self._check_ready(task)

    def _device_done(self, task: WorkOrder) -> None:
        with self.pool.lock:
            t0 = time.perf_counter()
            tally = self.pool.tally
            tally.device_notifications += 1
            if task.state is not GONE:
                tally.dependency_wakes += 1
                task.unready -= 1
                self._check_ready(task)
            tally.bookkeeping_s += time.perf_counter() - t0

    def _check_ready(self, task: WorkOrder) -> None:
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

    def take_all(self) -> list[WorkOrder]:
        """Remove every queued (not running) task, in submission order (``cancel_pending``)."""
        tasks = sorted(self._order + [t for _, _, t in self._ready] + list(self._waiting.values()), key=_seq_of)
        self._order, self._ready, self._waiting = [], [], {}
        for t in tasks:
            t.state = GONE
        return tasks

    def _queued(self) -> list[WorkOrder]:
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

    def first_waiting(self) -> WorkOrder | None:
        """The next task the lane would run, if any."""
        queued = self._queued()
        return queued[0] if queued else None

    # Called with the pool lock held. Returns (task, error, wait_s): a task to run (or to fail with
    # ``error``), else how long the lane may sleep before its oldest waiting task times out.
    def _next(self, now: float):
        tally = self.pool.tally
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
    def _taken(task: WorkOrder) -> WorkOrder:
        task.state = GONE
        return task

    def _loop(self) -> None:
        self.pool.on_lane_start(self)
        cv = self.pool.lane_idle
        tally = self.pool.tally
        while True:
            with self.cond:
                while True:
                    if self.pool.stopping:
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


def _seq_of(task: WorkOrder) -> int:
    return task.seq
