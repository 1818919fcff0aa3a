"""fp16 with loss scaling under the overlapped optimizer: a step with an inf gradient is skipped whole.

Lightning's ``16-mixed`` steps through ``GradScaler.step``, which calls ``optimizer.step()`` only when
no gradient overflowed. Under the overlapped optimizer no layer may have stepped during backward
(the strategy turns early steps off when the precision plugin has a scaler), so a skipped step
leaves every layer's weights and optimizer state as they were. On the CPU backend the host-scaled
plugin (a ``torch.amp.GradScaler("cpu")``, fp16 autocast) runs both under RoundPipe and under
Lightning's default strategy, so the two runs are compared step for step.
"""

import copy

import lightning as L
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from _exact_models import LAYERED, SeqModule, fit, weights
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.lightning.precision import HostScaledMixedPrecision

INF_STEP = 1


class InfAtStep(L.Callback):
    """An inf in the first layer's gradient at one step, through a tensor hook (no Lightning gradient hook,
    which would by itself keep layers from stepping early); records what that step changed, and how many
    optimizer steps (whole, or one per layer under the overlap) each training step ran."""

    def __init__(self):
        self.step_calls: dict[int, int] = {}
        self.before = self.after = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        self.post = register_optimizer_step_post_hook(
            lambda *a: self.step_calls.__setitem__(step, self.step_calls.get(step, 0) + 1))
        if step == INF_STEP:
            self.before = (weights(pl_module), copy.deepcopy(trainer.optimizers[0].state_dict()["state"]))
            self.inf = next(pl_module.parameters()).register_hook(lambda g: torch.full_like(g, float("inf")))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        getattr(trainer.strategy, "join", lambda: None)()  # RoundPipe: the overlapped layer steps are done
        self.post.remove()
        if self.before is not None and self.after is None:
            self.inf.remove()
            self.after = (weights(pl_module), copy.deepcopy(trainer.optimizers[0].state_dict()["state"]))


def run(strategy, devices):
    m, cb, plugin = SeqModule(opt="adamw"), InfAtStep(), HostScaledMixedPrecision()
    trainer, _ = fit(m, strategy, devices=devices, max_steps=3, plugins=[plugin], callbacks=[cb], record_grads=False)
    return m, cb, plugin, trainer


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[p][k], b[p][k]) for p in a for k in a[p])


@pytest.mark.timeout(60)
def test_an_inf_gradient_skips_the_whole_overlapped_step_and_no_layer_stepped_early():
    ours, cb, plugin, trainer = run(RoundPipeStrategy(microbatches=2, **LAYERED), 3)
    (w_before, s_before), (w_after, s_after) = cb.before, cb.after
    assert cb.step_calls.get(INF_STEP, 0) == 0  # no layer's optimizer step ran in the skipped step, early or late
    assert cb.step_calls[0] > 0 and cb.step_calls[2] > 0  # the others stepped (the hook sees layer steps)
    assert all(torch.equal(w_before[k], w_after[k]) for k in w_before)
    assert same_state(s_before, s_after)
    assert plugin.scaler.get_scale() == 2.0**15  # halved once, by the one overflow
    ref, ref_cb, ref_plugin, _ = run("auto", 1)
    assert ref_cb.step_calls.get(INF_STEP, 0) == 0 and ref_plugin.scaler.get_scale() == plugin.scaler.get_scale()
    w, w_ref = weights(ours), weights(ref)
    assert all(((w[k] - w_ref[k]).norm() / w_ref[k].norm()).item() < 1e-2 for k in w)  # fp16 matmuls on both sides


def test_the_strategy_keeps_layers_from_stepping_early_under_a_loss_scaler():
    strategy = RoundPipeStrategy(microbatches=2, **LAYERED)
    seen = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.append([ov.early_steps for ov in trainer.strategy.runtime.overlapped])

    fit(SeqModule(), strategy, devices=2, max_steps=1, plugins=[HostScaledMixedPrecision()], callbacks=[Probe()],
        record_grads=False)
    fit(SeqModule(), RoundPipeStrategy(microbatches=2, **LAYERED), devices=2, max_steps=1, callbacks=[Probe()],
        record_grads=False)
    assert seen == [[False], [True]]
