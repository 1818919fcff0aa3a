"""When an accumulation-only backward may return before its weight-gradient tail, under Lightning.

With ``accumulate_grad_batches=k`` Lightning runs ``training_step`` and ``backward`` k times and
steps the optimizer after the last. A backward that only accumulates (Lightning marks it by
entering the strategy's ``block_backward_sync``) may return once its stages are submitted, so
the next batch's pipelined forward starts while the pipeline still drains
(``RoundPipeRuntime.returning_early``): the gradients are added to ``.grad`` when that forward
enters the engine, or at the optimizer step, ``join``, a checkpoint, validation or the end of
fit, whichever comes first, in the order a waiting backward adds them (exact).

It may only if no code that Lightning runs between that backward and the next pipelined call
may read ``.grad`` directly: the LightningModule's ``backward`` (it runs the backward itself),
``on_after_backward``, ``on_train_batch_end`` and ``on_train_batch_start``, and the same hooks of
a user's callback. Lightning's own callbacks and the project's (classes defined in
``lightning``, ``pytorch_lightning`` or ``lightning_roundpipe``) read no gradients there; what
they read of the weights goes through the strategy, which finishes the tail first. Manual
optimization decides its own steps: it waits. ``on_before_optimizer_step`` and clipping run
after the step's closure, which finishes the tail (``RoundPipeStrategy.optimizer_step``).

Not caught (documented in ``StrategyOptions.overlap_calls``): a ``training_step`` that reads
``.grad`` before it calls the pipelined module. ``overlap_calls=False`` makes every backward wait.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

MODULE_HOOKS = ("backward", "on_after_backward", "on_train_batch_end", "on_train_batch_start")
CALLBACK_HOOKS = ("on_after_backward", "on_train_batch_end", "on_train_batch_start")
KNOWN_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_roundpipe.")


def calls_may_overlap(trainer: "pl.Trainer", module: "pl.LightningModule") -> bool:
    """True when no user code between an accumulation-only backward and the next batch's forward
    may read the gradients it adds."""
    if not module.automatic_optimization:
        return False
    if any(is_overridden(hook, module, parent=pl.LightningModule) for hook in MODULE_HOOKS):
        return False
    return not any(is_overridden(hook, cb, parent=pl.Callback)
                   for cb in trainer.callbacks if not type(cb).__module__.startswith(KNOWN_PACKAGES)
                   for hook in CALLBACK_HOOKS)
