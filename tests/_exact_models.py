"""Shared by the tests/engine/test_exact_*.py and tests/optim/test_exact_*.py files: parity runs against Lightning's default strategy."""

from __future__ import annotations

import threading

import torch

from _models import SeqModule, fit, grad_error, weight_error, weights
from lightning_roundpipe import RoundPipeStrategy

GRAD_TOL = 1e-5
# Several backward stages (equal weight bytes, recompute), so that layers complete, and step, one
# stage at a time: what tests of steps during backward and of failures between layers need (the
# default plan of a tiny model may be one stage per direction).
# overlap_optimizer set: these tests exercise the overlapped path, which the default leaves off on small hosts
LAYERED = {"partition": "params", "recompute": "always", "overlap_optimizer": True}
WEIGHT_TOL = 1e-4


def parity(make_module, devices=2, max_steps=5, strategy_kwargs=None, **trainer_kwargs):
    """(gradient error of step 1, weight error after ``max_steps``) against the default strategy.

    The weights come from runs without the gradient-recording callback: a callback overriding
    ``on_before_optimizer_step`` keeps every layer step after the closure, and the early steps
    during backward are what these runs must check."""
    strategy = lambda: RoundPipeStrategy(**(strategy_kwargs or {"microbatches": 2}))  # noqa: E731
    _, g_ref = fit(make_module(), "auto", max_steps=1, **trainer_kwargs)
    _, g = fit(make_module(), strategy(), devices=devices, max_steps=1, **trainer_kwargs)
    ref = make_module()
    w0 = weights(ref)
    fit(ref, "auto", max_steps=max_steps, record_grads=False, **trainer_kwargs)
    m = make_module()
    assert all(torch.equal(a, b) for a, b in zip(weights(m).values(), w0.values()))
    fit(m, strategy(), devices=devices, max_steps=max_steps, record_grads=False, **trainer_kwargs)
    return grad_error(g, g_ref), weight_error(weights(m), weights(ref), w0)


def our_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("roundpipe"))


__all__ = ["GRAD_TOL", "WEIGHT_TOL", "SeqModule", "fit", "grad_error", "our_threads", "parity", "weight_error",
           "weights"]


def seeded_reference(layers, x: torch.Tensor, base_seed: int, microbatches: int) -> torch.Tensor:
    """What the pipeline computes for ``x`` in ``microbatches``, unpipelined: every layer of every
    microbatch run with the generator seeded to its ``layer_seed`` (the engine's rule), outputs
    concatenated in microbatch order."""
    from lightning_roundpipe.engine import layer_seed

    outs = []
    for i, mb in enumerate(x.tensor_split(microbatches)):
        h = mb
        for l, layer in enumerate(layers):
            torch.manual_seed(layer_seed(base_seed, l, i))
            h = layer(h)
        outs.append(h)
    return torch.cat(outs)


def snapshot(net, opt):
    """Copies of ``net``'s parameters, the optimizer's state of each (by parameter name) and its groups'
    hyper-parameters: what a failed step must leave exactly as it found."""
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    state = {n: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
             for n, p in net.named_parameters() if p in opt.state}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params, state, groups


def assert_same(before, after):
    """Two ``snapshot``s are equal bit for bit (names the first tensor that differs)."""
    (p0, s0, g0), (p1, s1, g1) = before, after
    assert p0.keys() == p1.keys()
    for n in p0:
        assert torch.equal(p0[n], p1[n]), n
    assert s0.keys() == s1.keys()
    for n in s0:
        assert s0[n].keys() == s1[n].keys()
        for k in s0[n]:
            assert torch.equal(torch.as_tensor(s0[n][k]), torch.as_tensor(s1[n][k])), (n, k)
    assert g0 == g1
