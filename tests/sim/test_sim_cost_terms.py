"""Hand-computed cases of the cost terms of issue 23: compiled layers, the reference's precision,
the failed-step undo and the host optimizer's update order."""

from __future__ import annotations

import pytest

from lightning_roundpipe.cost.compiled import (FUSED_BACKWARD_LAUNCHES, FUSED_FORWARD_LAUNCHES, compiled_launches,
                                               fused_elementwise_bytes_per_token)
from lightning_roundpipe.cost.hardware import HardwareProfile, load_hardware
from lightning_roundpipe.cost.host_update import UNDO_BYTES_PER_PARAM, update_seconds
from roundpipe_lab.analysis.precision import check_precision, fp16_accumulation, loss_scaled
from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.cost.transformer import ModelShape, elementwise_bytes_per_token, get_model_shape, shape_layer_costs
from lightning_roundpipe.cost.view import CostView
from lightning_roundpipe.sim import SimConfig
from lightning_roundpipe.cost.graph_timing import LaneTimer, LaneWork, LinkSpec
from lightning_roundpipe.tracing.records import HOST_WORKER
from lightning_roundpipe.sim.simulate import add_optimizer

pytestmark = pytest.mark.timeout(30)

# hidden 8, intermediate 16, q 2 x 4 = 8, kv 1 x 4 = 4, one layer, no q/k norm
TINY = ModelShape("tiny", 8, 16, 2, 1, 4, 32, 1)


def slow_gpu(**rates) -> HardwareProfile:
    """1000 FLOP/s fp32-accumulate matmuls and attention, 2000 fp16-accumulate, 1000 B/s memory."""
    fields = dict(name="slow", num_gpus=1, tflops=1e-9, gpu_memory_bytes=10**12, host_device_bytes_per_s=1e12,
                  host_memory_bytes=10**12, cpu_optimizer_params_per_s=1e12, tensor_tflops_fp32_acc=1e-9,
                  tensor_tflops_fp16_acc=2e-9, memory_bytes_per_s=1000.0, attention_tflops=1e-9)
    return HardwareProfile(**{**fields, **rates})


def test_fused_elementwise_traffic_by_hand():
    # eager: 2 norms x 36 x 8 + 2 residuals x 6 x 8 + rotary 20 x (8 + 4) + MLP 10 x 16 = 1072 bytes
    # compiled: (4 + 8 + 6) x 8 + 4 x 12 + 6 x 16 = 288 bytes
    assert elementwise_bytes_per_token(TINY) == 1072
    assert fused_elementwise_bytes_per_token(8, 12, 16) == 288
    # Qwen3-1.7B (q/k norms too): 405,504 eager, 86,016 compiled
    qwen = get_model_shape("qwen3-1.7b")
    assert elementwise_bytes_per_token(qwen) == 405_504
    assert fused_elementwise_bytes_per_token(qwen.hidden, qwen.q_dim + qwen.kv_dim, qwen.intermediate) == 86_016


@pytest.mark.parametrize("compiled, precision, forward_s", [
    # projections 2 x 576 = 1152 FLOPs at 1000/s, attention 2 x 1 x 8 = 16 FLOPs at 1000/s, traffic at 1000 B/s
    (False, "bf16-mixed", 1.152 + 0.016 + 1.072),
    (True, "bf16-mixed", 1.152 + 0.016 + 0.288),
    (False, "fp16-acc", 0.576 + 0.016 + 1.072),  # projections at the fp16-accumulate 2000 FLOP/s
    (True, "fp16-acc", 0.576 + 0.016 + 0.288),
])
def test_decoder_layer_time_by_hand(compiled, precision, forward_s):
    costs = shape_layer_costs(TINY, slow_gpu(), seq_len=1, fp16_accumulation=fp16_accumulation(precision),
                              compiled_layers=compiled)
    layer = costs.layers[1]
    assert layer.forward_s == pytest.approx(forward_s)
    # backward: 4 x 576 projections, 2.5 x 16 attention, twice the traffic
    traffic = 2 * (288 if compiled else 1072)
    rate = 2000 if precision == "fp16-acc" else 1000
    assert layer.backward_s == pytest.approx(4 * 576 / rate + 40 / 1000 + traffic / 1000)


def test_compiled_launches_by_hand():
    hw = compiled_launches(load_hardware("rtx4090"))
    assert (FUSED_FORWARD_LAUNCHES, FUSED_BACKWARD_LAUNCHES) == (14, 46)
    assert hw.launch_seconds("forward", 2) == pytest.approx(2 * 14 * 1.5e-5)
    assert hw.launch_seconds("backward", 3) == pytest.approx(3 * 46 * 1.5e-5)
    assert load_hardware("rtx4090").launch_seconds("backward", 3) == pytest.approx(3 * 149 * 1.5e-5)


def test_precision_names():
    assert fp16_accumulation("fp16-acc") and not fp16_accumulation("bf16-mixed") and not fp16_accumulation("16-mixed")
    assert loss_scaled("fp16-acc") and loss_scaled("16-mixed") and not loss_scaled("bf16-mixed")
    with pytest.raises(ValueError, match=r"precision must be one of \['16-mixed', 'bf16-mixed', 'fp16-acc'\], got 'fp8'"):
        check_precision("fp8")
    profile = load_hardware("rtx4090")  # the reference's GPU has the fp16-accumulate rate, twice the other
    assert (profile.matmul_tflops_fp16_acc, profile.matmul_tflops_fp32_acc) == (263, 132)


def test_undo_copy_by_hand():
    # 100 params/s Adam (4000 B/s host memory / 40 B); the copy moves 24 B per parameter at 4000 B/s
    hw = slow_gpu(host_memory_bytes_per_s=4000.0)
    assert UNDO_BYTES_PER_PARAM == 24
    assert update_seconds(100, hw) == pytest.approx(1.0)
    assert update_seconds(100, hw, UNDO_BYTES_PER_PARAM) == pytest.approx(1.0 + 0.6)


def _updates(order: str) -> dict[str, tuple[float, float]]:
    # Gradients of layers 2 then 1 (backward's order) home together at t = 1; 100 and 50 params at 100 params/s.
    layer = [LayerCost(0, 0, 0, 1, 1, 1, params=p, trainable_params=p) for p in (10, 50, 100)]
    view = CostView(CostProfile(layer, tokens_per_microbatch=1))
    hw = slow_gpu(cpu_optimizer_params_per_s=100.0)
    sim = LaneTimer(LinkSpec(1e12))
    home = sim.add(LaneWork(HOST_WORKER, "main", "grads home", "", -1, 0, seconds=1.0))
    grads = {n: [home] for n in (2, 1)}
    add_optimizer(sim, grads, view, hw, SimConfig(optimizer_order=order), 0)
    sim.run()
    return {r.stage: (r.start, r.end) for r in sim.records if r.kind == "optim"}


def test_update_order_by_hand():
    # arrival: layer 2 [1, 2], then layer 1 [2, 2.5]; layer order: layer 1 [1, 1.5] first, then layer 2 [1.5, 2.5]
    assert _updates("arrival") == {"L2": (1.0, 2.0), "L1": (2.0, 2.5)}
    assert _updates("layer") == {"L1": (1.0, 1.5), "L2": (1.5, 2.5)}
    with pytest.raises(ValueError, match="optimizer_order must be 'arrival' or 'layer', got 'random'"):
        SimConfig(optimizer_order="random")
