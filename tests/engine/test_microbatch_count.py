"""Issue 20 items 15 and 16: a microbatch count far above the batch's samples plans in bounded time and
runs exactly (one sample per microbatch), instead of hanging in the planner; an empty batch is refused."""

import time
import warnings

import pytest
import torch

from _models import SeqModule, fit, weights
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.cost.profile import StageCost
from lightning_roundpipe.planning.predictor import SCHEDULED_MICROBATCHES, list_schedule


def _stages(m):
    one = dict(microbatch_compute_s=1e-3, microbatch_upload_s=2e-4, microbatch_download_s=1e-4, weight_upload_s=5e-3,
               grad_download_s=5e-3, weight_bytes=1, grad_bytes=1, activation_bytes=1)
    return [StageCost(kind, 0, 1, m, **one) for kind in ("forward", "forward", "backward", "backward")]


@pytest.mark.timeout(30)
def test_the_timing_model_takes_as_long_for_a_million_microbatches_as_for_a_few_hundred():
    start = time.perf_counter()
    step, busy, forward_end = list_schedule(_stages(10**6), [0, 1, 0, 1], 2, 2, 1e-3)
    assert time.perf_counter() - start < 1.0
    # the steady state: every microbatch adds the compute of the busiest worker (two stages of 1 ms each)
    assert step == pytest.approx(10**6 * 2e-3, rel=1e-3)
    assert busy == pytest.approx(4 * 10**6 * 1e-3) and 0 < forward_end < step
    # at and below the limit nothing is extrapolated: one more microbatch adds what scheduling it adds
    at = list_schedule(_stages(SCHEDULED_MICROBATCHES), [0, 1, 0, 1], 2, 2, 1e-3)[0]
    assert list_schedule(_stages(SCHEDULED_MICROBATCHES + 1), [0, 1, 0, 1], 2, 2, 1e-3)[0] == pytest.approx(
        at + 2e-3, rel=1e-6)


@pytest.mark.timeout(60)
def test_a_million_microbatches_on_a_batch_of_eight_runs_one_sample_each_exactly():
    ref, got = SeqModule(opt="adamw"), SeqModule(opt="adamw")
    fit(ref, RoundPipeStrategy(microbatches=8), devices=2, max_steps=2, record_grads=False)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(got, RoundPipeStrategy(microbatches=10**6), devices=2, max_steps=2, record_grads=False)
    assert time.perf_counter() - start < 30  # was: 6.7 s for 20,000 microbatches, over 390 s for 100,000
    assert any("batch of 8 is smaller than microbatches=1000000; running 8 microbatches of one sample" in str(w.message)
               for w in caught)
    for k, v in weights(ref).items():
        assert torch.equal(weights(got)[k], v), k


def test_an_empty_batch_is_refused_saying_so():
    from torch import nn

    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
    from lightning_roundpipe.engine.microbatch import MicrobatchError

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        # before: RuntimeError: number of sections must be larger than 0, got 0
        with pytest.raises(MicrobatchError, match=r"^the batch is empty \(0 samples along dim 0\): there is nothing to "
                                                  r"split into microbatches\. Give the pipelined module at least one"):
            net(torch.zeros(0, 8))
        assert net(torch.ones(2, 8)).shape == (2, 1)  # the runtime is still usable
    finally:
        rt.detach()
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
