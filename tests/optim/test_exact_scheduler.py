"""The overlapped optimizer under an LR scheduler: the default strategy's learning rates, no order warning."""

import warnings

import lightning as L
import pytest

from _models import SeqModule, fit
from lightning_roundpipe import RoundPipeStrategy


class LearningRates(L.Callback):
    def __init__(self):
        self.lrs = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.lrs.append([g["lr"] for g in trainer.optimizers[0].param_groups])


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("interval,batch_size,steps", [("step", 4, 8), ("epoch", 8, 30)])
def test_learning_rates_match_default_strategy_without_order_warning(opt, interval, batch_size, steps):
    ref = LearningRates()
    fit(SeqModule(opt=opt, scheduler=True, scheduler_interval=interval), "auto", max_steps=steps, batch_size=batch_size,
        callbacks=[ref], record_grads=False)
    got = LearningRates()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(SeqModule(opt=opt, scheduler=True, scheduler_interval=interval), RoundPipeStrategy(microbatches=2, overlap_optimizer=True),
            devices=2, max_steps=steps, batch_size=batch_size, callbacks=[got], record_grads=False)
    assert got.lrs == ref.lrs
    assert len(set(map(tuple, ref.lrs))) > 1  # the schedule really changed the rate
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "lr_scheduler" in m or "optimizer.step()" in m], messages
