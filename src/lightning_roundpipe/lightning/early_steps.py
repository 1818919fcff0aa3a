"""When the overlapped optimizer may step a layer during backward, under Lightning.

A layer's update can start as soon as its gradients are on the host only if nothing between
``backward()`` and ``optimizer.step()`` can still change gradients: no clipping, no AMP
scaler, manual optimization, or hooks that may edit ``.grad`` (the LightningModule's or a
callback's). Otherwise layers step right after the closure, in layer order.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

GRADIENT_HOOKS = ("on_before_optimizer_step", "on_after_backward", "configure_gradient_clipping")


def early_steps_allowed(trainer: "pl.Trainer", module: "pl.LightningModule", precision_plugin) -> bool:
    """True when nothing after ``backward()`` can change the gradients the layer steps use."""
    if trainer.gradient_clip_val or getattr(precision_plugin, "scaler", None) is not None:
        return False
    if not module.automatic_optimization:
        return False
    if any(is_overridden(hook, module, parent=pl.LightningModule) for hook in GRADIENT_HOOKS):
        return False
    return not any(is_overridden("on_before_optimizer_step", cb, parent=pl.Callback) for cb in trainer.callbacks)
