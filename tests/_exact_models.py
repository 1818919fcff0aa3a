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

