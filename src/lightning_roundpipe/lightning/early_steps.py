"""When the overlapped optimizer may step a layer during backward, under Lightning.

Only if nothing between ``backward()`` and ``optimizer.step()`` can still change gradients: no
clipping, no manual optimization, no user hook or override that may edit ``.grad`` there.
Otherwise layers step right after the closure, in layer order. Tensor hooks on parameters need
no such care (the engine runs them as gradients are added); under ``16-mixed`` with the host
loss scaler and the undo on, layers still step early, each checking its own gradients. The rules
in full: docs/design.md, design notes, ``lightning/early_steps.py``.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from .precision import HostScaledMixedPrecision

MODULE_GRADIENT_HOOKS = ("on_before_optimizer_step", "on_after_backward", "configure_gradient_clipping",
                         "backward", "optimizer_step")
CALLBACK_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def layer_loss_scaler(precision_plugin, undo: bool):
    """The scaler layers unscale their gradients with as they step early (None: no scaler, or one
    whose check must see every gradient first; see the module doc)."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is None or not undo or not isinstance(precision_plugin, HostScaledMixedPrecision):
        return None
    return scaler if scaler.is_enabled() else None


def early_steps_allowed(trainer: "pl.Trainer", module: "pl.LightningModule", precision_plugin,
                        undo: bool = True) -> bool:
    """True when nothing after ``backward()`` can change the gradients the layer steps use (a loss
    scaler only when ``layer_loss_scaler`` gives it; ``undo``: the failed-step undo is on)."""
    if trainer.gradient_clip_val:
        return False
    if getattr(precision_plugin, "scaler", None) is not None and layer_loss_scaler(precision_plugin, undo) is None:
        return False
    if not module.automatic_optimization:
        return False
    if any(is_overridden(hook, module, parent=pl.LightningModule) for hook in MODULE_GRADIENT_HOOKS):
        return False
    return not any(is_overridden(hook, cb, parent=pl.Callback)
                   for cb in trainer.callbacks for hook in CALLBACK_GRADIENT_HOOKS)


def unscales_inside_step(optimizer) -> bool:
    """Whether ``optimizer`` unscales loss-scaled gradients in its own ``step`` (fused Adam and the
    like), so ``GradScaler.step`` leaves the unscaling to it: stepped whole, not layer by layer."""
    # No public query exists: GradScaler.step and Lightning read this same attribute.
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))
