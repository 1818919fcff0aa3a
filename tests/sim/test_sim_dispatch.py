"""Per-task host dispatch in the simulator: the SimConfig overrides, the host-bound point, the measured figure."""

from __future__ import annotations

import pytest

from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.cost.hardware import HardwareProfile, load_hardware
from lightning_roundpipe.sim import SimConfig, simulate_roundpipe

INF = float("inf")
FUSED = Plan(1, ((0, 1),), ((0, 1),), fused_last=True)


def hw(num_gpus: int = 1, dispatch_s: float = 0.0, launch_s: float = 0.0) -> HardwareProfile:
    """Free transfers and optimizer: only compute and the host's dispatch and launches take time."""
    return HardwareProfile(name="ideal", num_gpus=num_gpus, tflops=1.0, gpu_memory_bytes=10**12,
                           host_device_bytes_per_s=INF, host_memory_bytes=10**12, cpu_optimizer_params_per_s=INF,
                           dispatch_s=dispatch_s, launch_s=launch_s, forward_launches_per_layer=2,
                           backward_launches_per_layer=3)


def costs(forward_s: float, backward_s: float, layers: int = 1) -> CostProfile:
    layer = LayerCost(forward_s, forward_s, backward_s, 100, 100, 10, params=10, trainable_params=10)
    return CostProfile([layer] * layers, tokens_per_microbatch=1, decoder_layers=(0, layers))


def step_s(plan, profile, hardware, microbatches, **config) -> float:
    return simulate_roundpipe(plan, profile, hardware, microbatches, config=SimConfig(steps=4, **config)).step_s


def test_config_dispatch_overrides_the_profile():
    # One fused stage, 2 microbatches: weights, then per microbatch input, compute and loss, then
    # the weight gradient: 1 + 3 x 2 + 1 = 8 submissions; free compute, so the step is 8 x 1 s.
    assert step_s(FUSED, costs(0, 0), hw(), 2, dispatch_s=1.0) == pytest.approx(8.0)
    assert step_s(FUSED, costs(0, 0), hw(dispatch_s=1.0), 2, dispatch_s=0.0) == pytest.approx(0.0)
    assert step_s(FUSED, costs(0, 0), hw(dispatch_s=1.0), 2) == pytest.approx(8.0)  # None: the profile's


def test_config_launch_overrides_the_profile():
    # The fused task of one decoder layer launches 3 kernels per microbatch: 2 x 3 x 0.5 s = 3 s.
    assert step_s(FUSED, costs(0, 0), hw(launch_s=1.0), 2, launch_s=0.5) == pytest.approx(3.0)
    assert step_s(FUSED, costs(0, 0), hw(launch_s=1.0), 2, launch_s=0.0) == pytest.approx(0.0)


def test_host_submissions_hide_behind_compute_until_the_host_is_the_limit():
    # 2 workers, plan F 0:1 | F 1:2 fused | B 0:1, one microbatch, 0.1 s per submission, free
    # transfers. The host submits 15 tasks one after another: F0 weights, input, forward, output
    # (4); F1 weights, input, fused, loss, input gradient, weight gradient (6); B0 weights, output
    # gradient, saved input, backward, weight gradient (5): 1.5 s.
    # Long computes (F0 1 s, fused 1 + 2 s, B0 recompute + backward 1 + 2 s: a 7 s chain) hide all
    # but the first three submissions: 0.3 + 7 = 7.3 s.
    # Computes 100x shorter (a 0.07 s chain) leave the workers waiting: the step ends with the
    # host's last submission, 15 x 0.1 = 1.5 s.
    ranges = ((0, 1), (1, 2))
    plan = Plan(2, ranges, ranges, fused_last=True)

    def profile(scale):
        layer = LayerCost(scale, scale, 2 * scale, 100, 100, 10, params=10, trainable_params=10)
        return CostProfile([layer] * 2, tokens_per_microbatch=1)

    def one_step(scale, dispatch_s):
        return simulate_roundpipe(plan, profile(scale), hw(2), 1, config=SimConfig(steps=1, dispatch_s=dispatch_s))

    assert one_step(1.0, 0.1).step_s == pytest.approx(7.3)
    assert one_step(1.0, 0.0).step_s == pytest.approx(7.0)
    short = one_step(0.01, 0.1)
    assert short.step_s == pytest.approx(1.5)
    assert sum(1 for r in short.timeline if r.queue == "main" and r.kind == "submit") == 15


def test_cpu_profile_carries_the_measured_dispatch_figure():
    # benchmarks/calibration/dispatch_cost.py's engine figure (host CPU per task of a training call, the
    # layers' own work extrapolated away); see the comment in cost/profiles/cpu2.yaml.
    assert 1e-5 <= load_hardware("cpu2").dispatch_s <= 1e-3
    assert load_hardware("rtx4090").dispatch_s == 0.0  # the GPU profiles leave it to SimConfig / own_engine
