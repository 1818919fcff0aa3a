"""A packed NF4 base priced against the same run in bf16, from the formulas of cost/quantization.py:
upload and worker bytes (dense: bf16 Linear weights; MoE: fp32 fused experts, cost/transformer.py),
dequantization seconds at the profile's memory bandwidth, the experts an MoE layer dequantizes, and
the simulator's weight uploads of a step (the packed bytes cross the link)."""

import pytest

from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.task_seconds import ProfileDeviceTimes
from lightning_roundpipe.cost.quantization import (dequantized_params_per_call, nf4_bytes_per_param,
                                                   packed_params_per_layer)
from lightning_roundpipe.cost.transformer import get_model_shape
from lightning_roundpipe.planning.fit import model_costs
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.sim.simulate import SimConfig, simulate_roundpipe
from lightning_roundpipe.workers.completions import TaskLabel

HW = load_hardware("rtx4090")  # 1008 GB/s of GPU memory bandwidth, 25 GB/s per host link
NF4 = 0.5 + (1 + 4 / 256) / 64  # 4-bit codes, 8-bit block scales, fp32 scale of 256 scales


def _pair(model: str, seq_len: int = 2048):
    shape = get_model_shape(model)
    return shape, model_costs(shape, HW, seq_len, 1, 16), model_costs(shape, HW, seq_len, 1, 16, quantize="nf4")


def test_dense_layer_uploads_holds_and_dequantizes_the_packed_bytes():
    shape, bf16, nf4 = _pair("qwen3-8b")
    projections = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 12288  # q, k, v, o; gate, up, down
    assert packed_params_per_layer(shape) == projections
    packed = round(projections * NF4)
    for i in range(1, 37):  # every decoder layer; the embedding and the head stay bf16
        layer, plain = nf4.layers[i], bf16.layers[i]
        assert plain.weight_bytes - layer.weight_bytes == projections * 2 - packed
        assert plain.held_weight_bytes - layer.held_weight_bytes == projections * 2 - packed
        dequant = projections * (NF4 + 2) / 1008e9  # read packed, write bf16, once per layer compute
        assert layer.forward_s - plain.forward_s == pytest.approx(dequant, rel=1e-12)
        assert layer.recompute_s - plain.recompute_s == pytest.approx(dequant, rel=1e-12)
        assert layer.backward_s - plain.backward_s == pytest.approx(dequant, rel=1e-12)
    for i in (0, 37):
        assert nf4.layers[i] == bf16.layers[i]


def test_moe_layer_packs_fp32_fused_experts_and_dequantizes_the_experts_hit():
    shape, bf16, nf4 = _pair("qwen3-235b-a22b")
    attention = 4096 * 8192 + 2 * 4096 * 512 + 8192 * 4096
    experts = 128 * 3 * 4096 * 1536
    assert packed_params_per_layer(shape) == attention + experts
    # under bf16-mixed the attention's Linear weights travel bf16, the fused expert tensors fp32
    saved = attention * 2 + experts * 4 - round((attention + experts) * NF4)
    layer, plain = nf4.layers[1], bf16.layers[1]
    assert plain.weight_bytes - layer.weight_bytes == saved
    assert plain.held_weight_bytes - layer.held_weight_bytes == saved
    assert layer.weight_bytes == pytest.approx((attention + experts) * NF4 + (plain.weight_bytes - attention * 2
                                                                             - experts * 4), abs=1)
    # one token runs the attention and its 8 routed experts; 2048 tokens hit all 128 (to 1e-50)
    assert dequantized_params_per_call(shape, 1) == pytest.approx(attention + 8 * 3 * 4096 * 1536, rel=1e-12)
    assert dequantized_params_per_call(shape, 2048) == pytest.approx(attention + experts, rel=1e-12)
    hit_two = 128 * (1 - (120 / 128) ** 2)  # 15.53 experts hit by two tokens on average
    assert dequantized_params_per_call(shape, 2) == pytest.approx(attention + hit_two * 3 * 4096 * 1536, rel=1e-12)
    assert layer.forward_s - plain.forward_s == pytest.approx((attention + experts) * (NF4 + 2) / 1008e9, rel=1e-9)
    # the largest projection dequantized (q_proj 4096 x 8192, bf16) joins both working sets, per token
    largest = -(-4096 * 8192 * 2 // 2048)
    assert layer.forward_transient_bytes_per_token - plain.forward_transient_bytes_per_token == largest
    assert layer.backward_transient_bytes_per_token - plain.backward_transient_bytes_per_token == largest


def test_the_simulator_uploads_the_packed_weights_of_every_stage():
    shape, bf16, nf4 = _pair("qwen3-8b", 1024)
    forward = ((0, 10), (10, 19), (19, 28), (28, 37), (37, 38))
    backward = ((0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 30), (30, 37), (37, 38))
    plan = Plan(38, forward, backward, fused_last=True).validate()
    uploaded = {}
    for name, costs in (("bf16", bf16), ("nf4", nf4)):
        result = simulate_roundpipe(plan, costs, HW, 8, config=SimConfig(steps=2))
        records = [r for r in result.timeline if r.step == 1 and r.queue == "upload" and r.kind == "weights"]
        uploaded[name] = sum(r.bytes for r in records)
        # every stage once (the fused head's forward stage is its backward), each its layers' weight bytes
        stages = forward + backward[:-1]
        assert uploaded[name] == sum(costs.layers[i].weight_bytes for a, b in stages for i in range(a, b))
    packed_saving = 36 * (packed_params_per_layer(shape) * 2 - round(packed_params_per_layer(shape) * NF4))
    assert uploaded["bf16"] - uploaded["nf4"] == 2 * packed_saving  # each decoder layer goes up twice per step


def test_emulated_gpus_time_a_packed_stages_upload_and_its_dequantization_as_the_simulator():
    shape, bf16, nf4 = _pair("qwen3-8b", 1024)
    plan = Plan(38, ((0, 19), (19, 37), (37, 38)), ((0, 19), (19, 37), (37, 38)), fused_last=True).validate()
    for costs in (bf16, nf4):
        times = ProfileDeviceTimes(plan, costs, HW, [1] * 38)
        uploaded = sum(costs.layers[i].weight_bytes for i in range(19, 37))
        # the stage's uploaded bytes over the link (a trainable adapter is held wider than it travels)
        assert times(TaskLabel("weights", "F1"), 18) == pytest.approx(HW.latency_s + uploaded / 25e9, rel=1e-12)
        assert sum(costs.layers[i].held_weight_bytes for i in range(19, 37)) > uploaded
        assert times(TaskLabel("forward", "F1"), 0) == pytest.approx(sum(costs.layers[i].forward_s for i in range(19, 37)))
    dequant = 18 * packed_params_per_layer(shape) * (NF4 + 2) / 1008e9
    forward = [ProfileDeviceTimes(plan, c, HW, [1] * 38)(TaskLabel("forward", "F1"), 0) for c in (bf16, nf4)]
    assert forward[1] - forward[0] == pytest.approx(dequant, rel=1e-9)
