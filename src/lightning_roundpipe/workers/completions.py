"""Completions: the events that order work across queues and workers, and the errors they carry.

A :class:`Completion` is set when its task's work is *issued*: on the CPU backend that means
done; on the CUDA backend it means enqueued on a stream, with a CUDA event recorded after it,
so another queue can order itself after it without blocking the host. Host code that needs the
data calls :meth:`Completion.wait`, which also waits for the CUDA event.

Every wait has a timeout. Errors name the task (kind, stage, microbatch, worker, queue) and,
for worker exceptions, carry the original traceback.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TaskLabel:
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


class PipelineError(RuntimeError):
    """Base class of the errors the pipeline raises to the caller."""


class WorkerError(PipelineError):
    """A task failed on a worker. ``__cause__`` is the original exception; the message holds its traceback."""

    def __init__(self, label: TaskLabel, original: BaseException, tb_text: str):
        self.label = label
        self.original = original
        self.worker_traceback = tb_text
        super().__init__(
            f"{type(original).__name__} in task [{label}]: {original}\n"
            f"--- original traceback on the worker ---\n{tb_text.rstrip()}"
        )


class PipelineTimeout(PipelineError, TimeoutError):
    """A wait ran past its timeout. The message names the task waited on and what it was waiting for."""


class Completion:
    """Set once when a task has issued its work; may instead fail with an error."""

    __slots__ = ("label", "_flag", "error", "cuda_event", "_notifier", "waiters", "value")

    def __init__(self, label: TaskLabel, notifier: Any = None):
        self.label = label
        self._flag = threading.Event()
        self.error: PipelineError | None = None
        self.cuda_event: Any = None
        # The pool whose lanes may wait for this completion: told when it is set, it wakes the
        # lanes that registered in ``waiters`` (only those: no thundering herd of every lane).
        self._notifier = notifier
        self.waiters: list | None = None
        self.value: Any = None  # what the task produced (device tensors, host tensors, ...)

    @classmethod
    def done(cls, label: TaskLabel, value: Any = None) -> "Completion":
        c = cls(label)
        c.value = value
        c._flag.set()
        return c

    def is_set(self) -> bool:
        return self._flag.is_set()

    def failed(self) -> bool:
        return self.error is not None

    def _notify(self) -> None:
        if self._notifier is not None:
            self._notifier._on_completion(self)

    def set(self, value: Any = None) -> None:
        self.value = value
        self._flag.set()
        self._notify()

    def fail(self, error: PipelineError) -> None:
        self.error = error
        self._flag.set()
        self._notify()

    def fail_from_exception(self, exc: BaseException) -> None:
        if isinstance(exc, PipelineError):
            self.fail(exc)
        else:
            tb_text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            err = WorkerError(self.label, exc, tb_text)
            err.__cause__ = exc
            self.fail(err)

    def wait(self, timeout: float, waiter: str = "the caller", diagnose=None) -> Any:
        """Block until set (and, on CUDA, the work is finished); raise its error or a timeout naming it."""
        if not self._flag.wait(timeout):
            extra = f"\n{diagnose()}" if diagnose is not None else ""
            raise PipelineTimeout(
                f"{waiter} timed out after {timeout:g}s waiting for [{self.label}] to complete{extra}"
            )
        if self.error is not None:
            raise self.error
        if self.cuda_event is not None:
            self.cuda_event.synchronize()
        return self.value
