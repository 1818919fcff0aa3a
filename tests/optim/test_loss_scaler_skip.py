"""fp16 with loss scaling under the overlapped optimizer: layers step early, and a step with an inf gradient
is skipped whole, its early steps put back.

Lightning's ``16-mixed`` steps through ``GradScaler.step``, which calls ``optimizer.step()`` only when no
gradient overflowed. Under the overlapped optimizer each layer unscales and checks its own gradients and steps
during backward (``optim/loss_scale.py``, ``optim/overlap.py``); an overflow anywhere, also in the last layer
to finish, puts every layer that stepped back from the undo's before-images, so the skipped step leaves every
weight and optimizer state tensor bit-identical, and the scaler backs off as after ``GradScaler.step``. On the
CPU backend the host-scaled plugin (a ``torch.amp.GradScaler("cpu")``, fp16 autocast) runs both under RoundPipe
and under Lightning's default strategy, so the two runs are compared step for step; and the same run with
early steps kept off (a no-op ``on_before_optimizer_step`` callback: the scaler's whole-optimizer path) gives
bit-identical weights, which pins the layer-by-layer unscaling to ``GradScaler.unscale_``'s.
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
FP16_TOL = 1e-2  # fp16 matmuls over 2 microbatches against one batch: rounding differs, the steps do not


class InfAtStep(L.Callback):
    """An inf at one step: in the first layer's gradient through a tensor hook (``where="grad"``: the last layer
    to finish backward, so every other layer has stepped early by then), or in one input sample (``"input"``:
    past fp16's range in one microbatch of the step's one call). Records what that step changed, the scale after every step,
    and how many optimizer steps (whole, or one per layer under the overlap) each training step ran. No
    Lightning gradient hook is overridden (that alone keeps layers from stepping early), unless ``late``."""

    def __init__(self, inf_step=INF_STEP, where="grad", layer=0):
        self.inf_step, self.where, self.layer = inf_step, where, layer
        self.step_calls: dict[int, int] = {}
        self.scales: list[float] = []
        self.before = self.after = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        self.post = register_optimizer_step_post_hook(
            lambda *a: self.step_calls.__setitem__(step, self.step_calls.get(step, 0) + 1))
        if step == self.inf_step:
            self.before = (weights(pl_module), copy.deepcopy(trainer.optimizers[0].state_dict()["state"]))
            if self.where == "grad":
                self.inf = next(pl_module.net[self.layer].parameters()).register_hook(
                    lambda g: torch.full_like(g, float("inf")))
            else:
                batch[0][-1, 0] = 1e6  # past fp16's 65504: the last sample's microbatch overflows in forward

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        getattr(trainer.strategy, "join", lambda: None)()  # RoundPipe: the overlapped layer steps are done
        self.post.remove()
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        if self.before is not None and self.after is None:
            if self.where == "grad":
                self.inf.remove()
            self.after = (weights(pl_module), copy.deepcopy(trainer.optimizers[0].state_dict()["state"]))


class LateSteps(L.Callback):
    """Overrides a gradient hook (doing nothing): layers step after the closure, through ``GradScaler.step``."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pass


def run(strategy, devices, opt="adamw", steps=3, growth_interval=None, callbacks=(), **cb_kwargs):
    m, cb, plugin = SeqModule(opt=opt), InfAtStep(**cb_kwargs), HostScaledMixedPrecision()
    if growth_interval:
        plugin.scaler.set_growth_interval(growth_interval)  # the scale grows within the run, too
    seen = {}

    class Overlapped(L.Callback):
        def on_train_end(self, trainer, pl_module):
            ov = getattr(trainer.strategy, "runtime", None)
            seen.update(overlapped=list(ov.overlapped) if ov is not None else [])

    trainer, _ = fit(m, strategy, devices=devices, max_steps=steps, plugins=[plugin],
                     callbacks=[cb, Overlapped(), *callbacks], record_grads=False)
    return m, cb, plugin, seen.get("overlapped", [])


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[p][k], b[p][k]) for p in a for k in a[p])


def close(a, b):
    return all(((a[k] - b[k]).norm() / b[k].norm()).item() < FP16_TOL for k in a)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("where", ["grad", "input"])
def test_an_inf_gradient_skips_the_whole_step_and_puts_back_the_layers_that_stepped_early(where):
    ours, cb, plugin, (ov,) = run(RoundPipeStrategy(microbatches=2, **LAYERED), 3, where=where)
    (w_before, s_before), (w_after, s_after) = cb.before, cb.after
    assert all(torch.equal(w_before[k], w_after[k]) for k in w_before)  # every layer as before, bit for bit
    assert same_state(s_before, s_after)  # AdamW's step counts and moments too
    assert cb.scales == [2.0**16, 2.0**15, 2.0**15]  # halved once, by the one overflow
    assert ov.skipped_steps == 1 and ov.early_layer_steps > 0
    # Only layer 0's gradient overflows (an fp16 inf input saturates in the first tanh: 0 * inf upstream of it),
    # and layer 0 finishes backward last: layers above it had stepped early, and were put back. How many of
    # the 5 did depends on timing (the lane runs layer 0's check before higher layers still waiting, and
    # those then skip), but the last layer steps as soon as its gradient is home, long before layer 0's.
    assert 1 <= cb.step_calls[INF_STEP] <= 5
    assert cb.step_calls[0] == cb.step_calls[2] == 6  # one step per layer in the good steps
    ref, ref_cb, ref_plugin, _ = run("auto", 1, where=where)
    assert ref_cb.step_calls.get(INF_STEP, 0) == 0 and ref_cb.scales == cb.scales
    assert all(torch.equal(ref_cb.before[0][k], ref_cb.after[0][k]) for k in w_before)
    assert close(weights(ours), weights(ref))  # fp16 matmuls on both sides


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_early_steps_under_the_scaler_match_the_default_strategy_and_the_late_steps_bit_for_bit(opt):
    """Five steps, the scale growing every 2 good steps, an overflow at step 2 (the tracker restarts)."""
    early, cb, plugin, (ov,) = run(RoundPipeStrategy(microbatches=2, **LAYERED), 2, opt=opt, steps=5,
                                   growth_interval=2, inf_step=2)
    assert cb.scales == [2.0**16, 2.0**17, 2.0**16, 2.0**16, 2.0**17]
    assert ov.early_layer_steps >= 4 * 5 and ov.skipped_steps == 1  # layers did step during backward
    late, late_cb, _, (late_ov,) = run(RoundPipeStrategy(microbatches=2, **LAYERED), 2, opt=opt, steps=5,
                                       growth_interval=2, inf_step=2, callbacks=[LateSteps()])
    assert late_ov.early_layer_steps == 0 and late_ov.loss_scaler is None
    assert late_cb.scales == cb.scales
    w, w_late = weights(early), weights(late)
    assert all(torch.equal(w[k], w_late[k]) for k in w)  # per-layer unscaling == GradScaler.unscale_
    ref, ref_cb, _, _ = run("auto", 1, opt=opt, steps=5, growth_interval=2, inf_step=2)
    assert ref_cb.scales == cb.scales and ref_cb.step_calls.get(2, 0) == 0
    assert close(w, weights(ref))


@pytest.mark.timeout(60)
def test_the_strategy_steps_layers_early_under_the_host_scaler_only_where_it_can_put_them_back():
    seen = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.append([(ov.early_steps, ov.loss_scaler is not None) for ov in trainer.strategy.runtime.overlapped])

    def probe(plugins=(), **kwargs):
        options = dict(microbatches=2, **LAYERED)
        options.update(kwargs.pop("strategy", {}))
        fit(SeqModule(), RoundPipeStrategy(**options), devices=2, max_steps=1, plugins=list(plugins),
            callbacks=[Probe()], record_grads=False, **kwargs)

    probe([HostScaledMixedPrecision()])
    probe()
    probe([HostScaledMixedPrecision()], gradient_clip_val=1.0)  # clipping reads every unscaled gradient first
    probe([HostScaledMixedPrecision()], strategy={"optimizer_undo": False})  # nothing to put back an early step with
    assert seen == [[(True, True)], [(True, False)], [(False, False)], [(False, False)]]


class FusedAdamW(SeqModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)  # unscales inside its own step


@pytest.mark.timeout(60)
def test_a_fused_optimizer_under_the_scaler_is_stepped_whole_as_the_default_strategy_steps_it():
    def train(strategy, devices):
        m, cb, seen = FusedAdamW(), InfAtStep(), {}

        class Overlapped(L.Callback):
            def on_train_end(self, trainer, pl_module):
                runtime = getattr(trainer.strategy, "runtime", None)
                seen["overlapped"] = list(runtime.overlapped) if runtime is not None else None

        fit(m, strategy, devices=devices, max_steps=3, plugins=[HostScaledMixedPrecision()],
            callbacks=[cb, Overlapped()], record_grads=False)
        return m, cb, seen["overlapped"]

    ours, cb, overlapped = train(RoundPipeStrategy(microbatches=2, **LAYERED), 2)
    assert overlapped == []  # stepped whole by Lightning: GradScaler.step hands it the scale and the inf flag
    ref, ref_cb, _ = train("auto", 1)
    assert cb.scales == ref_cb.scales == [2.0**16, 2.0**15, 2.0**15]
    assert cb.step_calls == ref_cb.step_calls == {0: 1, 1: 1, 2: 1}  # the fused step runs, skipping on found_inf
    assert all(torch.equal(cb.before[0][k], cb.after[0][k]) for k in cb.before[0])
    assert close(weights(ours), weights(ref))


@pytest.mark.timeout(60)
def test_early_steps_under_the_scaler_with_gradient_accumulation_match_the_late_steps_bit_for_bit():
    """Two batches per optimizer step: the first batch's backward only accumulates; layers step early in the last."""
    def train(callbacks=()):
        m, plugin, seen = SeqModule(opt="adamw"), HostScaledMixedPrecision(init_scale=1000.1), {}

        class Scales(L.Callback):
            def on_train_batch_end(self, trainer, *args):
                seen.setdefault("scales", []).append(trainer.precision_plugin.scaler.get_scale())
                seen["ov"] = trainer.strategy.runtime.overlapped[0]

        fit(m, RoundPipeStrategy(microbatches=2, **LAYERED), devices=2, max_steps=3, plugins=[plugin],
            callbacks=[Scales(), *callbacks], record_grads=False, accumulate_grad_batches=2)
        return weights(m), seen

    (w, seen), (w_late, seen_late) = train(), train([LateSteps()])
    assert seen["ov"].early_layer_steps > 0 and seen_late["ov"].early_layer_steps == 0
    assert seen["scales"] == seen_late["scales"] and len(seen["scales"]) >= 5  # per batch
    assert all(torch.equal(w[k], w_late[k]) for k in w)  # an init_scale fp32 cannot hold: rounded as GradScaler does


@pytest.mark.timeout(120)
@pytest.mark.parametrize("journal", [0, 1600])
def test_an_overflow_with_the_undo_journal_full_still_skips_the_whole_step(journal):
    """A journal of 1,600 B holds the AdamW before-images of the two top layers (Linear(8, 1): 512 B aligned;
    Linear(8, 8): 1,088 B); 0 holds none. Layers past it wait until every gradient is checked, so the overflow
    in layer 3 is found before any of them steps, though the lane runs layers 0-2 (lowest first) before it:
    the step is skipped whole, bit for bit, and the run ends where one with an unbounded journal ends."""
    bounded, cb, _, (ov,) = run(RoundPipeStrategy(microbatches=2, optimizer_undo_journal_bytes=journal, **LAYERED), 3,
                                layer=3)
    (w_before, s_before), (w_after, s_after) = cb.before, cb.after
    assert all(torch.equal(w_before[k], w_after[k]) for k in w_before) and same_state(s_before, s_after)
    assert cb.scales == [2.0**16, 2.0**15, 2.0**15] and ov.skipped_steps == 1
    assert sorted(ov._journaled) == ([4, 5] if journal else [])  # noqa: SLF001 - which units the journal held
    assert ov.journal_used_bytes == journal
    unbounded, _, _, _ = run(RoundPipeStrategy(microbatches=2, optimizer_undo_journal_bytes=None, **LAYERED), 3,
                             layer=3)
    w, w_ref = weights(bounded), weights(unbounded)
    assert all(torch.equal(w[k], w_ref[k]) for k in w)
