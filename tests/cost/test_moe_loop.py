"""Issue 23 item 4: the MoE expert dispatch's cost (cost/moe_loop.py), each term by hand, and the GPT-OSS check."""

import dataclasses

import pytest

from lightning_roundpipe.cost import moe_loop
from lightning_roundpipe.cost.hardware import HardwareProfile
from lightning_roundpipe.cost.moe_loop import (ExpertDispatch, batched_wave_efficiency, dispatch_cost, expected_capacity,
                                               wave_efficiency)
from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.cost.transformer import ModelShape, get_model_shape, shape_layer_costs
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.sim import SimConfig, simulate_roundpipe

INF = float("inf")
# hidden 128, experts of intermediate 256, 4 experts, top-2; 64 tokens: 128 routed rows, 32 per expert.
SHAPE = ModelShape("tiny-moe", 128, 256, 2, 1, 64, 1000, 2, num_experts=4, experts_per_token=2,
                   expert_intermediate=256)
HW = HardwareProfile("hand", 1, 1.0, 10**12, INF, 10**12, INF, latency_s=1e-5, tensor_tflops_fp32_acc=200,
                     tensor_tflops_fp16_acc=400, memory_bytes_per_s=1e12, matmul_tflops_fp32_acc=100,
                     matmul_tflops_fp16_acc=200)
LOOP = ExpertDispatch("hand loop", True, forward_kernels_per_expert=10, backward_kernels_per_expert=20,
                      forward_kernels_per_layer=3, backward_kernels_per_layer=4, syncs_per_expert=2, syncs_per_layer=1)
EXPERT_FLOPS = 128 * 2 * (128 * 256 * 2 + 256 * 128)  # routed rows x 2 x the three projections


def test_wave_efficiency_by_hand():
    # 1024 rows x 2880 columns in 128-tiles: 8 x 23 = 184 tiles, 2 waves of 128 SMs.
    assert wave_efficiency(1024, 2880, 128) == pytest.approx(1024 * 2880 / (2 * 128 * 128 * 128))
    assert wave_efficiency(128 * 16, 128 * 8, 128) == 1.0  # exactly one full wave
    assert wave_efficiency(0, 10, 128) == 1.0


def test_the_loop_terms_by_hand():
    cost = dispatch_cost(SHAPE, 64, HW, LOOP)
    moved = 128 * 14 * 128 / 1e12  # gather (4 B), weight multiply (4 B) and index_add (6 B) per hidden element
    # 32 rows per expert, one tile of rows: the 256-wide GEMMs use 32 x 256 of 128 SMs x 128^2, the 128-wide one half that
    efficiency = 3 / (1 / (32 * 256 / (128 * 128 * 128)) * 2 + 1 / (32 * 128 / (128 * 128 * 128)))
    lost = EXPERT_FLOPS * (1 / efficiency - 1) / 100e12
    syncs = (4 * 2 + 1) * 1e-5
    assert cost.forward_s == pytest.approx(moved + lost + syncs)
    scatter = 4 * 64 * 128 * 2 * 4 / 1e12  # per expert: zero-fill and add of the [T, hidden] input gradient
    assert cost.backward_s == pytest.approx(2 * moved + 2 * lost + scatter)
    assert (cost.forward_launches, cost.backward_launches) == (4 * 10 + 3, 4 * 20 + 4)


def test_the_grouped_dispatch_by_hand():
    bf16 = dispatch_cost(SHAPE, 64, HW, moe_loop.GROUPED)
    moved = 128 * 14 * 128 / 1e12
    assert (bf16.forward_s, bf16.backward_s) == (pytest.approx(moved), pytest.approx(2 * moved))
    assert (bf16.forward_launches, bf16.backward_launches) == (23, 19)
    # fp16 rows: grouped_mm refuses them, the padded bmm computes E / top_k = 2x the routed FLOPs
    fp16 = dispatch_cost(SHAPE, 64, HW, moe_loop.GROUPED, fp16_accumulation=True)
    assert fp16.forward_s == pytest.approx(moved + EXPERT_FLOPS * (4 / 2 - 1) / 200e12)
    assert fp16.backward_s == pytest.approx(2 * moved + 2 * EXPERT_FLOPS / 200e12)


def test_the_padded_capacity_and_batched_waves_by_hand():
    # 128 pairs over 4 experts: mean 32, x1.25 = 40 rows, rounded up to a 128-row tile; never above the tokens
    assert expected_capacity(128, 4, 64, 1.25) == 128
    assert expected_capacity(65536, 32, 16384, 1.25) == 2560  # GPT-OSS: 2,048 mean x 1.25, a multiple of 128
    assert expected_capacity(65536, 32, 16384, 1.0) == 2048
    assert expected_capacity(65536, 32, 16384, 9.0) == 16384  # capped by the tokens
    assert expected_capacity(100, 4, 64, 1.0, multiple=8) == 32  # 25 -> 32
    # 4 GEMMs of 128 x 256 outputs: 4 x 1 x 2 = 8 tiles, one wave of 128 SMs; 128 useful rows of 512
    assert batched_wave_efficiency(128, 4, 128, 256, 128) == pytest.approx(128 * 256 / (128 * 128 * 128))
    # 32 x 2560 x 2880: 32 x 20 x 23 = 14,720 tiles, 115 waves of 128 exactly; 65,536 useful rows
    assert batched_wave_efficiency(65536, 32, 2560, 2880, 128) == pytest.approx(65536 * 2880 / (115 * 128 * 128 * 128))
    assert batched_wave_efficiency(0, 4, 128, 256, 128) == 1.0


def test_the_padded_dispatch_by_hand():
    padded = dataclasses.replace(moe_loop.PADDED_BMM, load_imbalance=1.25)
    cost = dispatch_cost(SHAPE, 64, HW, padded, fp16_accumulation=True)
    moved = 128 * 14 * 128 / 1e12  # both dispatches' rows, as above
    # capacity 128 per expert (40 rounded up): 512 slots, 384 empty. Each GEMM runs 4 x 1 x 2 tiles (256 columns)
    # or 4 x 1 x 1 (128), one wave of 128 SMs x 128^2 either way, for 128 useful rows x its columns
    eff_256 = 128 * 256 / (128 * 128 * 128)
    eff_128 = 128 * 128 / (128 * 128 * 128)
    efficiency = 3 / (2 / eff_256 + 1 / eff_128)
    lost = EXPERT_FLOPS * (1 / efficiency - 1) / 200e12  # fp16 accumulation: bmm takes fp16
    block = (512 * 2 * 128 + 128 * 8 * 128 + 384 * 10 * 256) / 1e12  # zero fill, copy in and out, gate on empty slots
    assert cost.forward_s == pytest.approx(moved + lost + block + 1e-5)  # one host read per layer
    assert cost.backward_s == pytest.approx(2 * moved + 2 * lost + 2 * block)
    assert (cost.forward_launches, cost.backward_launches) == (28, 22)
    assert cost.graph_bytes_per_token == 384 * (128 + 3 * 256) * 2 / 64  # the empty slots' saved block tensors
    bf16 = dispatch_cost(SHAPE, 64, HW, padded)  # at bf16 the same work at the fp32-accumulate rate
    assert bf16.forward_s == pytest.approx(moved + EXPERT_FLOPS * (1 / efficiency - 1) / 100e12 + block + 1e-5)


def test_the_padded_dispatch_s_empty_slots_enter_the_layer_s_graph_bytes():
    plain = shape_layer_costs(SHAPE, HW, 64)
    padded = shape_layer_costs(SHAPE, HW, 64, moe_dispatch="padded_bmm")
    extra = dispatch_cost(SHAPE, 64, HW, moe_loop.PADDED_BMM).graph_bytes_per_token
    assert extra == 384 * (128 + 3 * 256) * 2 / 64
    assert [b.graph_bytes_per_token - a.graph_bytes_per_token for a, b in zip(plain.layers, padded.layers)] == \
        [0, extra, extra, 0]
    assert padded.extra_launches_per_decoder_layer == (28, 28 + 22)


def test_gpt_oss_gate_and_biases_move_more_bytes():
    gpt = dataclasses.replace(get_model_shape("gpt-oss-20b"))
    dispatch = moe_loop.for_shape("grouped", gpt.name)
    assert (dispatch.gate_bytes_per_intermediate, dispatch.biased) == (44, True)
    assert (dispatch.forward_kernels_per_layer, dispatch.backward_kernels_per_layer) == (32, 33)
    padded = moe_loop.for_shape("padded_bmm", gpt.name)
    assert (padded.forward_kernels_per_layer, padded.backward_kernels_per_layer, padded.biased) == (35, 38, True)
    assert padded.padded and padded.syncs_per_layer == 1 and not padded.bf16_only
    cost = dispatch_cost(gpt, 100, HW, dispatch)
    assert cost.forward_s == pytest.approx(400 * (14 * 2880 + 34 * 2880 + 4 * 2880) / 1e12)
    assert moe_loop.for_shape("reference_loop", gpt.name) is moe_loop.REFERENCE_GPT_OSS_LOOP
    assert moe_loop.for_shape("reference_loop", "Qwen3-30B-A3B") is moe_loop.REFERENCE_SWIGLU_LOOP
    with pytest.raises(ValueError, match="unknown expert dispatch 'fast'; use one of"):
        moe_loop.for_shape("fast", gpt.name)


def test_shape_costs_add_the_dispatch_to_moe_layers_only():
    plain = shape_layer_costs(SHAPE, HW, 64)
    looped = shape_layer_costs(SHAPE, HW, 64, moe_dispatch=LOOP)
    cost = dispatch_cost(SHAPE, 64, HW, LOOP)
    for a, b in zip(plain.layers[1:-1], looped.layers[1:-1]):
        assert b.forward_s - a.forward_s == pytest.approx(cost.forward_s)
        assert b.recompute_s - a.recompute_s == pytest.approx(cost.forward_s)
        assert b.backward_s - a.backward_s == pytest.approx(cost.backward_s)
    assert [x.forward_s for x in (plain.layers[0], plain.layers[-1])] == [x.forward_s for x in (looped.layers[0], looped.layers[-1])]
    assert looped.extra_launches_per_decoder_layer == (43, 43 + 84) and plain.extra_launches_per_decoder_layer == (0, 0)
    dense = dataclasses.replace(SHAPE, num_experts=0, experts_per_token=0, expert_intermediate=0)
    assert shape_layer_costs(dense, HW, 64, moe_dispatch=LOOP).layers[1] == shape_layer_costs(dense, HW, 64).layers[1]


def test_the_simulator_issues_the_dispatch_launches_on_the_host():
    # One worker, free compute: a step is its host launches. Fused task over 1 decoder layer:
    # (3 profile + 30 extra) launches x 1 s x 2 microbatches.
    hw = HardwareProfile(name="ideal", num_gpus=1, tflops=1.0, gpu_memory_bytes=10**12, host_device_bytes_per_s=INF,
                         host_memory_bytes=10**12, cpu_optimizer_params_per_s=INF, launch_s=1.0,
                         forward_launches_per_layer=2, backward_launches_per_layer=3)
    layer = LayerCost(0.0, 0.0, 0.0, 100, 100, 10, params=10, trainable_params=10)
    costs = CostProfile([layer], tokens_per_microbatch=1, decoder_layers=(0, 1), extra_launches_per_decoder_layer=(10, 30))
    fused = Plan(1, ((0, 1),), ((0, 1),), fused_last=True)
    split = Plan(1, ((0, 1),), ((0, 1),), fused_last=False)
    assert simulate_roundpipe(fused, costs, hw, 2, config=SimConfig(steps=4)).step_s == pytest.approx(2 * 33)
    # forward (2 + 10) then recompute + backward (3 + 30), per microbatch
    assert simulate_roundpipe(split, costs, hw, 2, config=SimConfig(steps=4)).step_s == pytest.approx(2 * (12 + 33))


@pytest.mark.timeout(60)
def test_gpt_oss_20b_with_the_reference_loop_is_within_25_percent_of_the_measurement():
    from roundpipe_lab.analysis.workload import Workload, reference_plan, simulate_workload

    plan = reference_plan("gpt-oss-20b")
    loop = simulate_workload("gpt-oss-20b", "rtx4090", Workload(128, 16, 1), plan=plan).tokens_per_s
    assert abs(loop / 18_121.59 - 1) <= 0.25  # the reference's measurement, artifact exp/raw-data.csv
    routed = simulate_workload("gpt-oss-20b", "rtx4090", Workload(128, 16, 1, moe_dispatch=None), plan=plan).tokens_per_s
    assert routed > 1.25 * loop  # the routed-FLOP model alone (the host optimizer's bound) was 1.47x the measurement
