"""Completions: the events that order work across queues and workers, and the errors they carry.

A ``Completion`` is set when its task's work is *issued*: on the CPU backend that means
done; on the stream backends (CUDA and its CPU fake) it means enqueued on a stream, with a
device event recorded after it, so another queue can order itself after it without blocking the
host. Host code that needs the data calls ``Completion.wait``, which also waits for that
event. On the fake-stream backend the value itself is produced by the stream's executor, so it
may be a ``Deferred`` that reading ``value`` resolves.

Every wait has a timeout (compile seconds do not count: ``compile_clock``). Errors name the task (kind, stage, microbatch, worker, queue) and,
for worker exceptions, carry the original traceback.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PipelineError, PipelineTimeout, WorkerError
from ..host.compile_clock import COMPILE_CLOCK, wait_excluding_compiles


@dataclass(frozen=True)
class TaskLabel:
    """What a task is: its kind, stage, microbatch and worker, as errors and traces name it."""
    kind: str  # "weights", "act_in", "forward", "backward", "fused", "act_out", "grad_in", "grad_out", "wgrad", "release"
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


def raised_from(exc: BaseException | None):
    """``exc`` and every exception it was raised from (each one's ``__cause__``, else its
    ``__context__``), each once: what a check for a kind of failure underneath looks through."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or was raised from, an out-of-memory error: a ``MemoryError`` (the CPU
    backend's cap) or ``torch.OutOfMemoryError`` (CUDA's allocator; a ``RuntimeError``, not a ``MemoryError``)."""
    return any(isinstance(e, (MemoryError, torch.OutOfMemoryError)) for e in raised_from(exc))


def forget_frames(exc: BaseException) -> None:
    """Drop the frames of ``exc`` and of what it was raised from: their locals (a failed task's
    device tensors) would stay allocated as long as the error lives. Call after formatting it."""
    for e in list(raised_from(exc)):
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None


def worker_error(label: TaskLabel, exc: BaseException) -> WorkerError:
    """A ``WorkerError`` naming the task, with the original traceback in its message (for an
    out-of-memory error, only there: its frames are dropped, see ``forget_frames``)."""
    tb_text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    err = WorkerError(label, exc, tb_text)
    err.__cause__ = exc
    if is_out_of_memory(exc):
        forget_frames(exc)
    return err


def _device_pending(c: "Completion") -> bool:
    return c.device_event is not None and not c.device_event.query()


class Completion:
    """Set once when a task has issued its work; may instead fail with an error.

    ``deps`` and ``started`` (monotonic time its lane began it, 0 before) let a timeout name the
    task that is really stuck rather than the one waited for (see ``WorkerPool.blocker``).
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
