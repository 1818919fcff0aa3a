"""Layers that update buffers in forward (BatchNorm): the default strategy's statistics with one microbatch,
GPipe's per-microbatch statistics with more when batch_statistics='per_microbatch' asks for them
(refused otherwise: tests/adapters/test_batch_statistics.py)."""

import warnings

import pytest
import torch
from torch import nn

from _exact_models import GRAD_TOL, WEIGHT_TOL, SeqModule, fit, parity, weights
from lightning_roundpipe import RoundPipeStrategy


class BatchNormModule(SeqModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(0)
        # no bias before a batch norm: its gradient is zero up to rounding, no metric for parity
        self.net = nn.Sequential(nn.Sequential(nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh()),
                                 nn.Sequential(nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8, momentum=None), nn.Tanh()),
                                 nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8), nn.Linear(8, 1))


def buffers(module):
    return {n: b.detach().clone() for n, b in module.named_buffers()}


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("recompute", ["always", "never"])
def test_batch_norm_with_one_microbatch_matches_default_strategy(opt, recompute):
    g_err, w_err = parity(lambda: BatchNormModule(opt=opt), devices=2,
                          strategy_kwargs={"microbatches": 1, "recompute": recompute, "partition": "uniform"})
    assert g_err <= GRAD_TOL and w_err <= WEIGHT_TOL, (g_err, w_err)
    ref, got = BatchNormModule(opt=opt), BatchNormModule(opt=opt)
    fit(ref, "auto", max_steps=4, record_grads=False)
    fit(got, RoundPipeStrategy(microbatches=1, recompute=recompute), devices=2, max_steps=4, record_grads=False)
    b_ref, b_got = buffers(ref), buffers(got)
    assert b_ref.keys() == b_got.keys()
    for k in b_ref:
        if k.endswith("num_batches_tracked"):
            assert int(b_got[k]) == int(b_ref[k]) == 4, k  # once per step: recompute does not count
        else:
            moved = (b_ref[k] - buffers(BatchNormModule(opt=opt))[k]).norm()
            assert moved > 0 and ((b_got[k] - b_ref[k]).norm() / moved).item() <= WEIGHT_TOL, k
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    ref.eval(), got.eval()
    with torch.no_grad():  # evaluation uses the running statistics
        assert torch.allclose(got.net(x), ref.net(x), rtol=1e-4, atol=1e-5)


def test_batch_norm_with_per_microbatch_statistics_counts_each_microbatch_without_a_warning():
    m = BatchNormModule()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(m, RoundPipeStrategy(microbatches=2, batch_statistics="per_microbatch"), devices=2, max_steps=3,
            record_grads=False)
    assert not [w for w in caught if "updates its buffers in forward" in str(w.message)]  # asked for: no warning
    assert int(m.net[0][1].num_batches_tracked) == 3 * 2
