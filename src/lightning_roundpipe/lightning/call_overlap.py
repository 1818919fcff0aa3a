"""When an accumulation-only backward may return before its weight-gradient tail, under Lightning.

With ``accumulate_grad_batches=k`` a backward that only accumulates may return once its stages
are submitted, so the next batch's forward starts while the pipeline drains; the gradients reach
``.grad`` before anything can read them, in the order a waiting backward adds them (exact). It
may only when no user code Lightning runs before the next pipelined call may read ``.grad``
(``on_after_backward``, batch hooks, a ``backward`` override, manual optimization). The rule in
full and what it cannot catch: docs/design.md, design notes, ``lightning/call_overlap.py``.
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
