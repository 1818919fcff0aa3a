"""Modules a failed step left partly updated (``optimizer_undo=False``, or past the undo journal).

The refusal outlives the runtime, so a new attach cannot train on from that state; it is lifted
when the weights are restored (a checkpoint load, or ``mark_restored``).
"""

from __future__ import annotations

import weakref

from torch import nn

from ..errors import StepFailed

_partly_updated: "weakref.WeakKeyDictionary[nn.Module, list[str]]" = weakref.WeakKeyDictionary()


def record_partly_updated(module: nn.Module, updated: list[str]) -> None:
    """A failed step updated the layers named in ``updated`` of ``module`` and could not put them back."""
    _partly_updated[module] = updated


def refuse_if_partly_updated(module: nn.Module, action: str) -> None:
    """Raise if a failed step with ``optimizer_undo=False`` left ``module`` partly updated."""
    updated = _partly_updated.get(module)
    if updated:
        raise StepFailed(
            f"cannot {action}: {type(module).__name__} is partly updated: a failed optimizer step reached "
            f"{', '.join(updated)} and not the other layers, and no copy was kept to put them back "
            "(optimizer_undo=False, or past the undo journal's bound): load its weights from a checkpoint (Trainer.fit(..., ckpt_path=...)), or load them yourself "
            "and call RoundPipeRuntime.mark_restored(module)")


def mark_restored(module: nn.Module) -> None:
    """``module``'s weights were restored (from a checkpoint) after a failed step with ``optimizer_undo=False``."""
    _partly_updated.pop(module, None)
