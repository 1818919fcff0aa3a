"""When the overlapped optimizer may step a layer during backward, under Lightning.

A layer's update can start as soon as its gradients are on the host only if nothing between
``backward()`` and ``optimizer.step()`` can still change gradients: no clipping, no AMP
scaler, manual optimization, or user code that Lightning runs there and that may edit
``.grad``: the LightningModule's ``on_after_backward``, ``on_before_optimizer_step``,
``configure_gradient_clipping``, its own ``backward`` or an ``optimizer_step`` override (whose
closure may edit gradients after the backward), and a callback's ``on_after_backward`` or
``on_before_optimizer_step``. Otherwise layers step right after the closure, in layer order.

Tensor hooks on the host parameters (``register_hook``, ``register_post_accumulate_grad_hook``)
need no such care: the engine runs them as it adds each stage's gradients
(``params/grad_hooks.py``), before the layer counts as complete.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

MODULE_GRADIENT_HOOKS = ("on_before_optimizer_step", "on_after_backward", "configure_gradient_clipping",
                         "backward", "optimizer_step")
CALLBACK_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def early_steps_allowed(trainer: "pl.Trainer", module: "pl.LightningModule", precision_plugin) -> bool:
    """True when nothing after ``backward()`` can change the gradients the layer steps use."""
    if trainer.gradient_clip_val or getattr(precision_plugin, "scaler", None) is not None:
        return False
    if not module.automatic_optimization:
        return False
    if any(is_overridden(hook, module, parent=pl.LightningModule) for hook in MODULE_GRADIENT_HOOKS):
        return False
    return not any(is_overridden(hook, cb, parent=pl.Callback)
                   for cb in trainer.callbacks for hook in CALLBACK_GRADIENT_HOOKS)
