"""What a failed task's error carries: the task's name, the original traceback as text, and no frames
that would keep the failed task's device tensors alive; out-of-memory errors recognised under any wrapping."""

from __future__ import annotations

import traceback

import torch

from ..errors import WorkerError

# ``TaskLabel`` (completions.py) is named only in annotations: completions.py imports this module.


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
