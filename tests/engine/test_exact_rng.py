"""Layers drawing random numbers (not only dropout): recompute draws what forward drew; same seed, same run."""

import lightning as L
import pytest
import torch
from torch import nn

from _exact_models import GRAD_TOL, SeqModule, fit, seeded_reference, weights
from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions


class Jitter(nn.Module):
    """Multiplicative noise, as Mixtral's router_jitter_noise does to the router input."""

    def forward(self, x):
        return x * torch.empty_like(x).uniform_(0.9, 1.1)


class SampledRouting(nn.Module):
    """Two experts; each row goes to one sampled from the router's softmax (torch.multinomial)."""

    def __init__(self, width):
        super().__init__()
        self.router = nn.Linear(width, 2)
        self.experts = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        choice = torch.multinomial(probs, 1).squeeze(1)
        out = torch.stack([e(x) for e in self.experts], 1)[torch.arange(x.shape[0]), choice]
        return out * probs.gather(1, choice[:, None]) + 0.01 * torch.randn_like(out)


def random_layers(width=8, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), Jitter(), nn.Tanh()), SampledRouting(width),
            nn.Sequential(nn.Linear(width, width), nn.Tanh()), SampledRouting(width),
            nn.Sequential(Jitter(), nn.Linear(width, 1))]


class RandomModule(SeqModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = nn.Sequential(*random_layers())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("microbatches,workers", [(2, 2), (3, 3)])
def test_recompute_reproduces_forward_random_numbers(microbatches, workers):
    """Gradients equal a plain autograd run that draws the same numbers (no recompute there)."""
    layers = random_layers()
    net = nn.Sequential(*layers)
    x, y = torch.randn(6, 8), torch.randn(6, 1)
    runtime = RoundPipeRuntime.attach(net, "cpu", workers, RuntimeOptions(microbatches=microbatches,
                                                                          step_metrics=False, testing={"jitter_s": 0.002}))
    try:
        torch.manual_seed(5)
        ((net(x) - y) ** 2).mean().backward()
        base = runtime.engine.last_run.rng.base_seed
        got = {n: p.grad.clone() for n, p in net.named_parameters()}
    finally:
        runtime.detach()
    net.zero_grad(set_to_none=True)
    ((seeded_reference(layers, x, base, microbatches) - y) ** 2).mean().backward()
    for n, p in net.named_parameters():
        assert ((got[n] - p.grad).norm() / p.grad.norm()).item() <= GRAD_TOL, n


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_same_seed_gives_bit_identical_runs_whatever_the_timing(opt):
    runs = []
    for jitter in (0.0, 0.003):
        L.seed_everything(7, verbose=False)
        m = RandomModule(opt=opt)
        fit(m, RoundPipeStrategy(microbatches=3, testing={"jitter_s": jitter}), devices=3, max_steps=4, record_grads=False)
        runs.append(weights(m))
    w0 = weights(RandomModule(opt=opt))
    assert any(not torch.equal(runs[0][k], w0[k]) for k in w0)
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


@pytest.mark.timeout(60)
@pytest.mark.parametrize("random", [False, True])
def test_caller_random_stream(random):
    """No layer draws: the caller's stream is as a plain run leaves it. Some do: advanced by one draw."""
    torch.manual_seed(0)
    net = nn.Sequential(*(random_layers() if random else [nn.Sequential(nn.Linear(8, 8), nn.Tanh())] * 1),
                        nn.Linear(8 if not random else 1, 1))
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        torch.manual_seed(11)
        expected = torch.get_rng_state()
        if random:
            torch.randint(0, 2**62, ())
            expected = torch.get_rng_state()
            torch.manual_seed(11)
        net(torch.randn(4, 8, generator=torch.Generator().manual_seed(0))).sum().backward()
        assert torch.equal(torch.get_rng_state(), expected)
    finally:
        runtime.detach()
