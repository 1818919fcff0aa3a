"""The split-invariance check's price in the cost model (issue 43): two host forwards of the first two
microbatches' rows; printed at a Qwen3-1.7B shape for the report."""

import pytest

from roundpipe_lab.analysis.split_check import HOST_FP32_FLOPS, forward_flops_per_token, split_check_seconds
from lightning_roundpipe.cost.transformer import get_model_shape


def test_forward_flops_per_token_is_twice_the_active_parameters_plus_attention():
    shape = get_model_shape("qwen3-1.7b")
    seq = 4096
    want = shape.num_layers * (2 * shape.active_linear_params() + 2 * seq * shape.q_dim) + 2 * shape.hidden * shape.vocab
    assert forward_flops_per_token(shape, seq) == want


def test_check_price_at_a_1_7b_shape():
    per_token = forward_flops_per_token("qwen3-1.7b", 4096)
    eight_microbatches = split_check_seconds("qwen3-1.7b", 4096, batch=8, microbatches=8)
    assert eight_microbatches == pytest.approx(2 * 2 * 4096 * per_token / HOST_FP32_FLOPS)  # 2 rows, 2 passes
    one = split_check_seconds("qwen3-1.7b", 4096, batch=8, microbatches=1)
    assert one == pytest.approx(2 * 4096 * per_token / HOST_FP32_FLOPS)  # two rows, one pass
    print(f"Qwen3-1.7B, 8 x 4096 tokens: check {eight_microbatches:.1f} s with 8 microbatches, {one:.1f} s with 1 "
          f"(host at {HOST_FP32_FLOPS:.0e} FLOP/s, assumed)")
