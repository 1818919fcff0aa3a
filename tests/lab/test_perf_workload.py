"""The reference workload in the simulator: accumulation across calls, stale vs synchronous optimizer."""

from __future__ import annotations

import pytest

from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.cost.hardware import HardwareProfile
from lightning_roundpipe.sim import SimConfig, simulate_roundpipe
from roundpipe_lab.analysis.workload import PUBLISHED_RUNS, Workload, optimizer_step_period

INF = float("inf")


def one_worker(optimizer_params_per_s: float, dispatch_s: float = 0.0) -> HardwareProfile:
    """Free transfers: only compute, the host optimizer (and dispatch) take time."""
    return HardwareProfile(name="ideal", num_gpus=1, tflops=1.0, gpu_memory_bytes=10**12, host_device_bytes_per_s=INF,
                           host_memory_bytes=10**12, cpu_optimizer_params_per_s=optimizer_params_per_s,
                           dispatch_s=dispatch_s)


def one_layer(forward_s=0.25, backward_s=0.75, trainable=300) -> CostProfile:
    layer = LayerCost(forward_s, forward_s, backward_s, 100, 100, 10, params=trainable, trainable_params=trainable)
    return CostProfile([layer], tokens_per_microbatch=1)


FUSED = Plan(1, ((0, 1),), ((0, 1),), fused_last=True)


def period(calls: int, microbatches: int, stale: bool, sync: bool, optimizer_steps=4, hw=None) -> float:
    cfg = SimConfig(steps=calls * optimizer_steps, accumulation=calls, stale_optimizer=stale, optimizer_barrier=sync)
    result = simulate_roundpipe(FUSED, one_layer(), hw or one_worker(100.0), microbatches, config=cfg)
    return optimizer_step_period(result, calls), result


def test_synchronous_optimizer_adds_its_update_to_every_step():
    # 2 calls x 3 microbatches x (0.25 + 0.75) s of fused compute = 6 s, then 300 params at 100/s = 3 s.
    step, result = period(calls=2, microbatches=3, stale=False, sync=True)
    assert step == pytest.approx(9.0)
    updates = [r for r in result.timeline if r.kind == "optim"]
    assert len(updates) == 4  # one per optimizer step, not one per call: the 2 calls accumulate
    assert {r.step for r in updates} == {1, 3, 5, 7}  # each after the step's last call


def test_stale_optimizer_hides_an_update_shorter_than_two_steps():
    # Step k + 1 needs only step k - 1's update: the 3 s update runs under the next 6 s step.
    step, _ = period(calls=2, microbatches=3, stale=True, sync=False)
    assert step == pytest.approx(6.0)


def test_stale_optimizer_longer_than_a_step_sets_the_period():
    # 1 call x 1 microbatch = 1 s of compute; the update takes 3 s and the host runs one at a time,
    # so in steady state one step ends per update: 3 s (a synchronous one would take 1 + 3 = 4 s).
    stale, _ = period(calls=1, microbatches=1, stale=True, sync=False, optimizer_steps=6)
    sync, _ = period(calls=1, microbatches=1, stale=False, sync=True, optimizer_steps=6)
    assert stale == pytest.approx(3.0)
    assert sync == pytest.approx(4.0)


def test_workload_sizes_and_published_rows():
    w = Workload(512, 10, 4)
    assert w.sequences_per_microbatch == pytest.approx(12.8) and w.tokens_per_step == 512 * 2048
    assert w.sim_config(3).steps == 12 and w.sim_config().accumulation == 4 and w.sim_config().stale_optimizer
    assert not w.sim_config().host_barriers  # the reference dispatches the next call without waiting
    qwen = PUBLISHED_RUNS[0]
    # RoundPipe-sync keeps the step's 512 sequences and splits them over 7 calls (the artifact's run.sh).
    assert (qwen.sync.calls, qwen.sync.sequences_per_step, qwen.sync.optimizer) == (7, 512, "sync")
    assert qwen.sync.sequences_per_microbatch == pytest.approx(512 / 70)
    with pytest.raises(ValueError, match="optimizer must be 'stale' or 'sync'"):
        Workload(8, 2, 2, optimizer="lazy")
    with pytest.raises(ValueError, match="accumulation must be at least 1"):
        SimConfig(accumulation=0)


# ----------------------------------------------------------------------------- host dispatch cost


def dispatch_period(forward_s: float, backward_s: float, microbatches: int, dispatch_s: float) -> float:
    costs = one_layer(forward_s, backward_s)
    result = simulate_roundpipe(FUSED, costs, one_worker(INF, dispatch_s), microbatches, config=SimConfig(steps=4))
    return result.step_s


def test_dispatch_cost_bounds_a_step_of_short_tasks():
    # One fused stage, 2 microbatches: the host submits the weights, then per microbatch its input,
    # compute and loss, then the weight gradient: 1 + 3 * 2 + 1 = 8 submissions of 1 s each, and
    # compute is free, so the step lasts as long as the host takes to submit it.
    assert dispatch_period(0.0, 0.0, 2, 1.0) == pytest.approx(8.0)
    assert dispatch_period(0.0, 0.0, 2, 0.0) == pytest.approx(0.0)


def test_dispatch_cost_hides_behind_long_computes_but_for_the_first_ones():
    # 10 s per microbatch: the first compute starts after 3 submissions (weights, input, compute);
    # the rest are submitted while it runs. Step = 3 * 1 + 2 * 10 = 23 s.
    assert dispatch_period(2.5, 7.5, 2, 1.0) == pytest.approx(23.0)


# ----------------------------------------------------------------------------- physical rates


def test_physical_rates_time_matmuls_attention_and_traffic_separately():
    from lightning_roundpipe.cost.physical import LayerWork, layer_seconds

    hw = one_worker(1.0).replace(tensor_tflops_fp32_acc=100.0, tensor_tflops_fp16_acc=200.0, memory_bytes_per_s=1e12)
    work = LayerWork(matmul_flops=2e12, attention_flops=1e12, memory_bytes=3e12)
    # fp16 accumulate: 2e12 / 200e12 + 1e12 / 100e12 (attention stays fp32-accumulate) + 3e12 / 1e12.
    assert layer_seconds(work, 1, hw, fp16_accumulation=True) == pytest.approx(0.01 + 0.01 + 3.0)
    assert layer_seconds(work, 2, hw, fp16_accumulation=False) == pytest.approx(2 * (0.02 + 0.01 + 3.0))
    # A profile without them: everything compute-bound at ``tflops`` (1 TFLOP/s), traffic free.
    assert layer_seconds(work, 1, one_worker(1.0)) == pytest.approx(3.0)


def test_rtx4090_profile_gives_the_whitepaper_rates():
    from lightning_roundpipe.cost.hardware import load_hardware

    hw = load_hardware("rtx4090")
    assert (hw.tensor_tflops_fp32_acc, hw.tensor_tflops_fp16_acc, hw.memory_bytes_per_s) == (165.2, 330.3, 1008e9)


def test_profile_rejects_negative_dispatch_and_non_positive_rates():
    with pytest.raises(ValueError, match="dispatch_s must not be negative, got -1"):
        one_worker(1.0, dispatch_s=-1.0)
    with pytest.raises(ValueError, match="memory_bytes_per_s must be positive when given, got 0"):
        one_worker(1.0).replace(memory_bytes_per_s=0)
