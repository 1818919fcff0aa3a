"""Issue 20 item 7: a BatchNorm in training mode with more than one microbatch is refused before
anything runs; batch_statistics='per_microbatch' gives GPipe's per-microbatch statistics, exactly
what running the layers on each microbatch in turn computes."""

from itertools import islice

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from _models import fit, make_data
from lightning_roundpipe import OptionError, RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from tests.engine.test_exact_buffers import BatchNormModule


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.timeout(60)
def test_batch_norm_with_two_microbatches_is_refused_before_any_weight_changes():
    m = BatchNormModule(opt="adamw")
    before = _state(m)
    # before: it ran, num_batches_tracked 12 instead of 6 after 6 steps, running_mean 0.1 and Adam state 0.05 off
    with pytest.raises(OptionError) as err:
        fit(m, RoundPipeStrategy(microbatches=2), devices=2, max_steps=6, record_grads=False)
    assert str(err.value).startswith(
        "RoundPipeStrategy(batch_statistics='refuse'): pipelined layer 0 (its `1`) is a BatchNorm1d in training mode: "
        "with microbatches=2 each microbatch would be normalised with its own statistics")
    assert "Use microbatches=1 for the exact result" in str(err.value)
    assert "batch_statistics='per_microbatch'" in str(err.value)
    after = _state(m)
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # weights and running statistics


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.timeout(90)
def test_per_microbatch_statistics_are_those_of_the_layers_run_on_each_microbatch_in_turn(opt):
    steps, microbatches = 3, 2
    got = BatchNormModule(opt=opt)
    fit(got, RoundPipeStrategy(microbatches=microbatches, batch_statistics="per_microbatch"), devices=2,
        max_steps=steps, record_grads=False)
    ref = BatchNormModule(opt=opt)  # by hand: every microbatch through the whole net in turn, one loss
    optimizer = ref.configure_optimizers()
    ref.train()
    for x, y in islice(DataLoader(make_data(), batch_size=8), steps):
        optimizer.zero_grad()
        out = torch.cat([ref.net(part) for part in x.tensor_split(microbatches)])
        ((out - y) ** 2).mean().backward()
        optimizer.step()
    want, have = _state(ref), _state(got)
    for k, v in want.items():
        if k.endswith("num_batches_tracked"):
            assert int(have[k]) == int(v) == steps * microbatches, k  # once per microbatch
        else:
            assert torch.allclose(have[k], v, rtol=1e-5, atol=1e-6), (k, (have[k] - v).abs().max())


def test_batch_norm_in_eval_mode_is_not_refused_and_in_training_mode_it_is():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        net[1].eval()  # a frozen backbone's norm: running statistics, per sample, exact
        want = torch.cat([net[2](net[1](net[0](part))) for part in x.tensor_split(2)])
        assert torch.allclose(net(x), want)
        net[1].train()
        with pytest.raises(OptionError, match=r"RuntimeOptions\(batch_statistics='refuse'\): pipelined layer 1 "):
            net(x)
        assert int(net[1].num_batches_tracked) == 0  # refused before the call ran
    finally:
        rt.detach()


def test_the_option_is_checked_and_in_the_hydra_config():
    with pytest.raises(OptionError, match=r"RoundPipeStrategy\(batch_statistics='sometimes'\): use one of 'refuse', "
                                          r"'per_microbatch'"):
        RoundPipeStrategy(batch_statistics="sometimes")
    from omegaconf import OmegaConf

    assert OmegaConf.load("conf/strategy/roundpipe.yaml").batch_statistics == "refuse"
