"""Parity with Lightning's default single-device strategy on the same LightningModule and data."""

import warnings

import lightning as L
import pytest
import torch

from _models import SeqModule, fit, grad_error, weight_error, weights
from lightning_roundpipe import RoundPipeStrategy

GRAD_TOL = 1e-5
WEIGHT_TOL = 1e-4

_reference_cache = {}


def reference(module_kwargs, trainer_kwargs):
    key = (tuple(sorted(module_kwargs.items())), tuple(sorted(trainer_kwargs.items())))
    if key not in _reference_cache:
        m = SeqModule(**module_kwargs)
        w0 = weights(m)
        _, g = fit(m, "auto", **trainer_kwargs)
        _reference_cache[key] = (w0, g, weights(m))
    return _reference_cache[key]


CASES = [
    # (workers, microbatches, recompute, module kwargs, trainer kwargs)
    (1, 1, "always", {}, {}),
    (2, 1, "always", {}, {}),
    (2, 2, "always", {}, {}),
    (3, 4, "always", {}, {}),
    (2, 4, "never", {}, {}),
    (3, 2, "never", {}, {}),
    (2, 2, "always", {}, {"accumulate_grad_batches": 2}),
    (2, 2, "always", {}, {"gradient_clip_val": 0.05}),
    (2, 2, "always", {"scheduler": True}, {}),
    (2, 2, "always", {"frozen": True}, {}),
    (2, 2, "always", {"tied": True}, {}),
    (3, 3, "never", {"tied": True}, {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}),
]


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("workers,microbatches,recompute,mkw,tkw", CASES)
def test_parity_with_single_device(opt, workers, microbatches, recompute, mkw, tkw):
    mkw = dict(mkw, opt=opt)
    w0, g_ref, w_ref = reference(mkw, tkw)
    m = SeqModule(**mkw)
    assert all(torch.equal(a, b) for a, b in zip(weights(m).values(), w0.values()))
    strategy = RoundPipeStrategy(microbatches=microbatches, recompute=recompute)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, g = fit(m, strategy, devices=workers, **tkw)
    ours = [str(w.message) for w in caught if "lightning_roundpipe" in w.filename]
    assert [w.startswith("RoundPipe has one worker") for w in ours] == ([True] if workers == 1 else [])
    assert grad_error(g, g_ref) <= GRAD_TOL
    assert weight_error(weights(m), w_ref, w0) <= WEIGHT_TOL
    if mkw.get("frozen"):
        for n, p in m.net[1].named_parameters():
            assert torch.equal(p, w0[f"net.1.{n}"]) and p.grad is None


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("workers,microbatches,recompute", [(3, 2, "always"), (3, 3, "never")])
def test_sticky_schedule_parity_with_single_device(opt, workers, microbatches, recompute):
    # The dispatch order decides only where stages run: the steps stay exact.
    w0, g_ref, w_ref = reference({"opt": opt}, {})
    m = SeqModule(opt=opt)
    strategy = RoundPipeStrategy(microbatches=microbatches, recompute=recompute, schedule="sticky")
    first_workers = []

    class FirstWorker(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            first_workers.append(trainer.strategy.runtime.engine.last_run.graph.stage_workers["F0"])

    _, g = fit(m, strategy, devices=workers, callbacks=[FirstWorker()])
    assert first_workers == [0] * 5  # every step's first stage on worker 0 (round-robin: 0 2 1 0 2)
    assert grad_error(g, g_ref) <= GRAD_TOL
    assert weight_error(weights(m), w_ref, w0) <= WEIGHT_TOL


def test_manual_optimization_parity():
    w0, g_ref, w_ref = reference({"manual": True}, {})
    m = SeqModule(manual=True)
    fit(m, RoundPipeStrategy(microbatches=2), devices=2)
    assert weight_error(weights(m), w_ref, w0) <= WEIGHT_TOL


def test_module_is_unchanged_after_fit():
    m = SeqModule()
    keys = list(m.state_dict().keys())
    fit(m, RoundPipeStrategy(microbatches=2), devices=2, max_steps=1)
    assert list(m.state_dict().keys()) == keys
    assert "forward" not in vars(m.net)  # the instance-level pipelined forward is removed at teardown
    x = torch.randn(3, 8)
    assert m.net(x).shape == (3, 1)
