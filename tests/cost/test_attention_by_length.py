"""Issue 23 item 5: flash attention's rate by sequence length, and the reference's layer grain, by hand."""

import pytest

from lightning_roundpipe.cost.attention import attention_flops_factor, attention_tflops_at, fixed_keys
from lightning_roundpipe.cost.hardware import HardwareProfile, load_hardware
from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.cost.transformer import get_model_shape, shape_layer_costs
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.sim import SimConfig, simulate_roundpipe


def test_the_fixed_work_per_query_by_hand():
    hw = load_hardware("rtx4090")  # attention 82, fp32-accumulate matmul 132 TFLOP/s
    assert fixed_keys(hw) == pytest.approx(2048 * (132 / 82 - 1))  # 1,249 keys
    assert attention_flops_factor(2048, hw) == pytest.approx(1.0)
    l0 = 2048 * 50 / 82
    assert attention_flops_factor(8192, hw) == pytest.approx((8192 + l0) / 8192 * 2048 / (2048 + l0))
    assert attention_tflops_at(8192, hw) == pytest.approx(132 * 8192 / (8192 + l0))  # 114.5
    assert attention_tflops_at(10**9, hw) == pytest.approx(132, rel=1e-5)
    assert attention_tflops_at(512, hw) == pytest.approx(132 * 512 / (512 + l0))
    # no achievable attention rate, or one not below the matmul rate: unchanged
    assert fixed_keys(hw.replace(attention_tflops=None)) == 0 and attention_tflops_at(8192, hw.replace(attention_tflops=None)) is None
    assert attention_flops_factor(8192, hw.replace(attention_tflops=140)) == 1.0


def test_decoder_layer_attention_time_follows_the_length():
    hw = load_hardware("rtx4090")
    shape = get_model_shape("qwen3-1.7b")
    at_2k = shape_layer_costs(shape, hw, 2048).layers[1]
    at_8k = shape_layer_costs(shape, hw, 8192).layers[1]
    # per token, the layer grows by its attention: 2 * q_dim * (8192 - 2048) more FLOPs forward at the
    # GEMM rate (the fixed work per query is the same); 2.5x that backward
    extra = 2 * shape.q_dim * (8192 - 2048) / 132e12
    assert at_8k.forward_s / (4 * 2048) - at_2k.forward_s / 2048 == pytest.approx(extra, rel=1e-9)
    assert at_8k.backward_s / (4 * 2048) - at_2k.backward_s / 2048 == pytest.approx(2.5 * extra, rel=1e-9)


def test_layer_inputs_from_the_forward_skip_the_extra_pass():
    # One worker, free transfers: a layer-grain backward of 2 layers (1 ms forward, 2 ms backward
    # each) is recompute + backward (6 ms), plus the no-grad pass over its first layer (1 ms) only
    # when the inputs are not kept by the forward.
    hw = HardwareProfile("hand", 1, 1.0, 10**9, 1e15, 10**9, 1e15)
    layer = lambda: LayerCost(1e-3, 1e-3, 2e-3, 8, 8, 10, params=2, trainable_params=2, graph_bytes_per_token=100)  # noqa: E731
    costs = CostProfile([layer(), layer()], tokens_per_microbatch=10, dtype_bytes=4, input_bytes_per_token=8)
    plan = Plan(2, ((0, 2),), ((0, 2),), fused_last=False)
    durations = {}
    for kept in (False, True):
        r = simulate_roundpipe(plan, costs, hw, 1, config=SimConfig(steps=2, layer_recompute=True,
                                                                     layer_inputs_from_forward=kept))
        durations[kept] = {round(x.end - x.start, 9) for x in r.timeline if x.queue == "compute" and x.kind == "backward"}
    assert durations == {False: {0.007}, True: {0.006}}


@pytest.mark.slow  # ~20 s: two long-sequence plans searched
@pytest.mark.timeout(90)
def test_the_reference_sweep_at_8k_and_64k_is_within_15_percent():
    from benchmarks.figures.long_sequence_throughput import SWEEP
    from roundpipe_lab.analysis.workload import Workload, simulate_workload

    for seq_len in (8192, 65536):
        sequences, grain, measured = SWEEP[seq_len]
        simulated = simulate_workload("qwen3-1.7b", "rtx4090", Workload(sequences, 10, 1, seq_len=seq_len,
                                                                          recompute=grain)).tokens_per_s
        assert abs(simulated / measured - 1) <= 0.15, seq_len
