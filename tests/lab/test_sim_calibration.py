"""The calibrated GPU model: achievable rates, eager element-wise traffic, the host optimizer's
memory bound, the reference's partitions, and the six published figures it reproduces."""

from __future__ import annotations

import pytest

from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.cost.hardware import HardwareProfile, load_hardware
from lightning_roundpipe.sim import SimConfig, simulate_roundpipe
from lightning_roundpipe.cost.physical import LayerWork, layer_seconds, matmul_tflops
from lightning_roundpipe.cost.transformer import ModelShape, decoder_layer_work, elementwise_bytes_per_token, head_work
from roundpipe_lab.analysis.workload import optimizer_step_period, reference_plan

INF = float("inf")


def worker(**changes) -> HardwareProfile:
    base = HardwareProfile(name="ideal", num_gpus=1, tflops=1.0, gpu_memory_bytes=10**12, host_device_bytes_per_s=INF,
                           host_memory_bytes=10**12, cpu_optimizer_params_per_s=INF,
                           tensor_tflops_fp32_acc=100.0, tensor_tflops_fp16_acc=200.0, memory_bytes_per_s=1e12)
    return base.replace(**changes)


def test_achievable_rates_replace_the_datasheet_peaks():
    work = LayerWork(matmul_flops=2e12, attention_flops=1e12, memory_bytes=1e12)
    # Peaks: 2e12 / 200e12 + 1e12 / 100e12 + 1e12 / 1e12 = 0.01 + 0.01 + 1.
    assert layer_seconds(work, 1, worker(), fp16_accumulation=True) == pytest.approx(1.02)
    # Achievable: 2e12 / 160e12 + 1e12 / 50e12 + 1 = 0.0125 + 0.02 + 1.
    sustained = worker(matmul_tflops_fp16_acc=160.0, matmul_tflops_fp32_acc=80.0, attention_tflops=50.0)
    assert layer_seconds(work, 1, sustained, fp16_accumulation=True) == pytest.approx(1.0325)
    # fp32 accumulation takes the other matmul rate: 2e12 / 80e12 = 0.025.
    assert layer_seconds(work, 1, sustained, fp16_accumulation=False) == pytest.approx(1.045)
    assert (matmul_tflops(sustained, True), matmul_tflops(worker(), True)) == (160.0, 200.0)
    with pytest.raises(ValueError, match="attention_tflops must be positive when given, got 0"):
        worker(attention_tflops=0)


def test_eager_elementwise_traffic_counts_each_pass():
    # hidden 10, q 8 (2 heads x 4), kv 4, intermediate 30, q/k norms:
    # 2 RMSNorms x 36 x 10 + 2 residual adds x 6 x 10 + rotary 20 x 12 + q/k norms 36 x 12 + MLP 10 x 30.
    shape = ModelShape("toy", hidden=10, intermediate=30, num_heads=2, num_kv_heads=1, head_dim=4, vocab=50,
                       num_layers=1, qk_norm=True)
    expected = 720 + 120 + 240 + 432 + 300
    assert elementwise_bytes_per_token(shape) == expected
    assert elementwise_bytes_per_token(shape, dtype_bytes=4) == 2 * expected
    fwd, bwd = decoder_layer_work(shape, seq_len=6)
    linear = 10 * 8 + 2 * 10 * 4 + 8 * 10 + 3 * 10 * 30  # q, k, v, o, gate, up, down
    assert (fwd.matmul_flops, fwd.attention_flops, fwd.memory_bytes) == (2 * linear, 2 * 6 * 8, expected)
    assert (bwd.matmul_flops, bwd.attention_flops, bwd.memory_bytes) == (4 * linear, 2.5 * 2 * 6 * 8, 2 * expected)
    # The LM head: a chunked compiled loss writes and reads the fp16 logits once each way.
    head_fwd, head_bwd = head_work(shape, chunked_loss=True)
    assert (head_fwd.matmul_flops, head_fwd.memory_bytes, head_bwd.matmul_flops) == (2 * 10 * 50, 4 * 50, 4 * 10 * 50)
    assert head_work(shape)[0].memory_bytes == 50 * 12  # Hugging Face's loss: fp16 logits + two fp32 copies


def test_host_optimizer_is_bound_by_host_memory_bandwidth():
    hw = worker(cpu_optimizer_params_per_s=1e6, host_memory_bytes_per_s=4000.0)
    assert hw.optimizer_params_per_s == pytest.approx(100.0)  # 4000 B/s over 40 B per update
    assert hw.replace(host_memory_bytes_per_s=None).optimizer_params_per_s == 1e6
    assert hw.replace(cpu_optimizer_params_per_s=50.0).optimizer_params_per_s == 50.0  # the compute side is lower
    # A synchronous step: 2 calls x 3 microbatches x 1 s of fused compute, then 300 parameters at
    # 100/s = 3 s: 9 s per optimizer step.
    layer = LayerCost(0.25, 0.25, 0.75, 100, 100, 10, params=300, trainable_params=300)
    plan = Plan(1, ((0, 1),), ((0, 1),), fused_last=True)
    cfg = SimConfig(steps=8, accumulation=2, optimizer_barrier=True)
    result = simulate_roundpipe(plan, CostProfile([layer], tokens_per_microbatch=1), hw, 3, config=cfg)
    assert optimizer_step_period(result, 2) == pytest.approx(9.0)
    with pytest.raises(ValueError, match="optimizer_bytes_per_param must be positive, got 0"):
        worker(optimizer_bytes_per_param=0)


def test_rtx4090_profile_loads_the_fitted_rates_and_host_bandwidth():
    hw = load_hardware("rtx4090")
    assert (hw.matmul_tflops_fp16_acc, hw.attention_tflops, hw.host_memory_bytes_per_s) == (263.0, 82.0, 85e9)
    assert hw.optimizer_params_per_s == pytest.approx(85e9 / 40)


def test_reference_plan_maps_the_published_partition_onto_our_layers():
    # Qwen3-1.7B: forward 7,7,7,7 decoder layers (the embedding with the first), the LM head fused
    # alone, backward 3 x 8 then 2, 2 from the top (the embedding with the last).
    plan = reference_plan("qwen3-1.7b")
    assert plan.to_text() == ("F 0:8 8:15 15:22 22:29 29:30 | B 0:3 3:5 5:8 8:11 11:14 14:17 17:20 20:23 23:26 "
                              "26:29 29:30 | fused")
    assert len(reference_plan("qwen3-32b").backward) == 65 and len(reference_plan("qwen3-32b").forward) == 23


def test_kernel_rate_fit_reproduces_the_profile_and_every_measured_time():
    from benchmarks.calibration.kernel_rates import fit

    rate_mm, rate_attn, residuals = fit()
    hw = load_hardware("rtx4090")
    assert rate_mm == pytest.approx(hw.matmul_tflops_fp16_acc, abs=1.0)
    assert rate_attn == pytest.approx(hw.attention_tflops, abs=1.0)
    assert len(residuals) == 12
    assert max(abs(predicted / measured - 1) for _, _, measured, predicted in residuals) < 0.11


@pytest.mark.timeout(300)
def test_published_figures_are_reproduced_within_15_percent():
    from benchmarks.validation.published_gpu import TARGET, rows

    table = rows("rtx4090")
    assert [(r["model"], r["system"]) for r in table] == [
        (m, s) for m in ("qwen3-1.7b", "llama-3.1-8b", "qwen3-32b") for s in ("RoundPipe", "RoundPipe-sync")]
    errors = {(r["model"], r["system"]): r["error"] for r in table}
    assert all(abs(e) <= TARGET for e in errors.values()), errors
