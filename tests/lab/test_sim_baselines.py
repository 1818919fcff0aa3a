"""Bound baselines: the Mobius-like stage-streamed schedule, on-GPU optimizer state, and the
published-baseline rows; the scaling curve against the reference's measured one."""

from __future__ import annotations

import pytest

from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.cost.hardware import HardwareProfile
from lightning_roundpipe.sim import SimConfig
from roundpipe_lab.analysis.bound_schedules import bound_order, simulate_bound

INF = float("inf")


def two_gpus(memory: int = 10**6) -> HardwareProfile:
    return HardwareProfile(name="ideal", num_gpus=2, tflops=1.0, gpu_memory_bytes=memory, host_device_bytes_per_s=INF,
                           host_memory_bytes=10**12, cpu_optimizer_params_per_s=INF)


def two_layers() -> CostProfile:
    # forward 1 s, recompute 1 s, backward 2 s per microbatch; 100-byte weights and gradients.
    layers = [LayerCost(1.0, 1.0, 2.0, 100, 100, 10, params=50, trainable_params=50) for _ in range(2)]
    return CostProfile(layers, tokens_per_microbatch=1)


def test_mobius_runs_each_gpus_stages_breadth_first():
    # GPU 1 of 2 with 2 chunks owns stages 1 and 3: every microbatch of 1, then of 3; backward reversed.
    assert bound_order("mobius", 1, 2, 2, chunks=2) == [
        ("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("F", 3, 1), ("B", 3, 0), ("B", 3, 1), ("B", 1, 0), ("B", 1, 1)]


def test_mobius_step_by_hand():
    # 2 GPUs, one stage each, 2 microbatches, free transfers and optimizer. Forward: GPU 0 runs
    # mb0 0-1, mb1 1-2; GPU 1 mb0 1-2, mb1 2-3. Backward (recompute + backward = 3 s): GPU 1 mb0
    # 3-6, mb1 6-9; GPU 0 mb0 6-9, mb1 9-12. The next step's forward waits for GPU 0: 12 s a step.
    result = simulate_bound("mobius", two_layers(), two_gpus(), 2, chunks_per_gpu=1, config=SimConfig(steps=3))
    assert result.fits and result.step_s == pytest.approx(12.0)
    assert result.notes["resident"] == [False, False]
    uploads = [r for r in result.timeline if r.kind == "weights" and r.step == 1]
    assert len(uploads) == 4  # each stage's weights once per direction
    # Two stages' weights and gradients fit only when the worker has room for them.
    assert not simulate_bound("mobius", two_layers(), two_gpus(memory=300), 2, chunks_per_gpu=1).fits


def test_on_gpu_optimizer_state_counts_in_the_bound_memory_check():
    plain = simulate_bound("1f1b", two_layers(), two_gpus(), 2, offload="resident")
    megatron = simulate_bound("1f1b", two_layers(), two_gpus(), 2, offload="resident", optimizer_state_bytes_per_param=14)
    # 14 bytes for each of the 50 trainable parameters of the GPU's one layer.
    assert [m - p for m, p in zip(megatron.notes["estimated_gpu_bytes"], plain.notes["estimated_gpu_bytes"])] == [700, 700]
    tight = max(plain.notes["estimated_gpu_bytes"]) + 100
    assert simulate_bound("1f1b", two_layers(), two_gpus(memory=tight), 2, offload="resident", memory_fraction=1.0).fits
    oom = simulate_bound("1f1b", two_layers(), two_gpus(memory=tight), 2, offload="resident", memory_fraction=1.0,
                         optimizer_state_bytes_per_param=14)
    assert not oom.fits and oom.tokens_per_s == 0.0


@pytest.mark.slow  # a lab figure, about 7 s
@pytest.mark.timeout(300)
def test_published_baselines_are_bounded_and_megatron_32b_runs_out_of_memory():
    from benchmarks.validation.published_gpu import BASELINE_TARGET, baseline_rows

    rows = {(r["model"], r["system"]): r for r in baseline_rows("rtx4090")}
    assert rows[("qwen3-32b", "Megatron-PP-like")]["simulated"] is None  # OOM, as measured
    assert rows[("qwen3-32b", "Megatron-PP-like")]["peak_gib"] > 24
    assert abs(rows[("qwen3-1.7b", "Megatron-PP-like")]["error"]) <= BASELINE_TARGET
    for model in ("qwen3-1.7b", "llama-3.1-8b", "qwen3-32b"):
        for optimizer in ("synchronous", "overlapped"):
            assert abs(rows[(model, f"Mobius-like ({optimizer} optimizer)")]["error"]) <= BASELINE_TARGET


@pytest.mark.timeout(120)
def test_scaling_follows_the_reference_measured_curve():
    from roundpipe_lab.analysis.scaling import MEASURED_SCALING, scaling_rows

    rows = scaling_rows(("llama-3.1-8b",), "rtx4090", (1, 2))
    assert [r.measured for r in rows] == list(MEASURED_SCALING["llama-3.1-8b"][:2])
    assert all(abs(r.tokens_per_s / r.measured - 1) < 0.10 for r in rows)
    # Another profile has no measured curve to show.
    assert scaling_rows(("llama-3.1-8b",), "a100", (1,))[0].measured is None
