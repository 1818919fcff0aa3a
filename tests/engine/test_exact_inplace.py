"""Layers that write their input in place train exactly when a stage starts at them."""

import pytest
import torch
from torch import nn

from _exact_models import GRAD_TOL, WEIGHT_TOL, SeqModule, parity


class HalveInPlace(nn.Module):
    """Writes its input: any custom layer doing ``x.mul_``."""

    def forward(self, x):
        return x.mul_(0.5)


class InPlaceModule(SeqModule):
    """Every layer starts with an in-place op, so every stage of every plan starts at one."""

    def __init__(self, first="relu", **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(0)
        make = (lambda: nn.ReLU(inplace=True)) if first == "relu" else HalveInPlace
        self.net = nn.Sequential(nn.Linear(8, 8),
                                 *[nn.Sequential(make(), nn.Linear(8, 8)) for _ in range(4)],
                                 nn.Sequential(make(), nn.Linear(8, 1)))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("first", ["relu", "mul_"])
@pytest.mark.parametrize("recompute,microbatches", [("always", 2), ("always", 3), ("never", 2)])
def test_in_place_layers_at_stage_starts_match_default_strategy(first, opt, recompute, microbatches):
    g_err, w_err = parity(lambda: InPlaceModule(first, opt=opt), devices=3,
                          strategy_kwargs={"microbatches": microbatches, "recompute": recompute,
                                           "partition": "uniform"})
    assert g_err <= GRAD_TOL, g_err
    assert w_err <= WEIGHT_TOL, w_err


@pytest.mark.timeout(60)
def test_in_place_layer_leaves_host_activations_and_input_alone():
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8)),
                        nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8)))
    x = torch.randn(4, 8, requires_grad=True)
    ref = nn.Sequential(*[nn.Sequential(nn.ReLU(), l[1]) for l in net])
    ref(x).pow(2).sum().backward()
    g_ref = [p.grad.clone() for p in net.parameters()]
    gx_ref = x.grad.clone()
    net.zero_grad(set_to_none=True)
    x.grad = None
    x_before = x.detach().clone()
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        net(x).pow(2).sum().backward()
        assert torch.equal(x.detach(), x_before)
        for p, g in zip(net.parameters(), g_ref):
            assert ((p.grad - g).norm() / g.norm()).item() <= GRAD_TOL
        assert ((x.grad - gx_ref).norm() / gx_ref.norm()).item() <= GRAD_TOL
    finally:
        runtime.detach()
