"""Reads of the inner model after ``optimizer_step`` returns see the updated weights (issue 20, item 3).

The overlapped optimizer's layer steps are slowed (``testing.optimizer_delay_s``) so that, without the
join at the end of the strategy's ``optimizer_step``, they would still be running when
``on_train_batch_end`` reads the weights. Parity against Lightning's default strategy, SGD and
AdamW."""

import lightning as L
import pytest
import torch

from _exact_models import LAYERED, WEIGHT_TOL, SeqModule, fit, weight_error, weights
from lightning_roundpipe import RoundPipeStrategy

SLOW_STEPS = {"microbatches": 2, "testing": {"optimizer_delay_s": 0.02}, **LAYERED}


class InnerEMA(L.Callback):
    """An exponential moving average over ``pl_module.net.parameters()`` (not the LightningModule's)."""

    def on_train_start(self, trainer, pl_module):
        self.params = dict(pl_module.net.named_parameters())
        self.ema = {n: p.detach().clone() for n, p in self.params.items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            for n, p in self.params.items():
                self.ema[n].mul_(0.5).add_(p, alpha=0.5)


class WeightNormLogger(L.Callback):
    """Logs each layer's weight norm, read by attribute from the inner model, after every step."""

    def __init__(self):
        self.norms: list[list[float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        net = pl_module.net
        layers = [net[i][0] for i in range(4)] + [net[4], net[5]]
        self.norms.append([layer.weight.norm().item() for layer in layers])
        pl_module.log("last_weight_norm", self.norms[-1][-1])


def _run(opt, callback, strategy):
    m = SeqModule(opt=opt)
    w0 = weights(m)
    cb = callback()
    if strategy == "auto":
        fit(m, "auto", max_steps=4, callbacks=[cb], record_grads=False)
    else:
        fit(m, RoundPipeStrategy(**SLOW_STEPS), devices=2, max_steps=4, callbacks=[cb], record_grads=False)
    return cb, w0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_ema_over_inner_model_matches_default_strategy(opt):
    ref, w0 = _run(opt, InnerEMA, "auto")
    got, _ = _run(opt, InnerEMA, "roundpipe")
    w0 = {n.removeprefix("net."): v for n, v in w0.items()}
    err = weight_error(got.ema, ref.ema, w0)
    assert err < WEIGHT_TOL, f"EMA {err:.2e} off the default strategy's"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_weight_norm_logger_reads_updated_weights(opt):
    ref, _ = _run(opt, WeightNormLogger, "auto")
    got, _ = _run(opt, WeightNormLogger, "roundpipe")
    assert len(got.norms) == len(ref.norms) == 4
    first = torch.tensor(SeqModule(opt=opt).net[5].weight.norm().item())
    for step, (a, b) in enumerate(zip(torch.tensor(got.norms), torch.tensor(ref.norms))):
        change = (b[-1] - first).abs()
        assert change > 0
        # every read within 1e-4 of what it logs changing, at every step
        assert ((a - b).abs() <= WEIGHT_TOL * change + 1e-6).all(), f"step {step}: {a.tolist()} vs {b.tolist()}"
