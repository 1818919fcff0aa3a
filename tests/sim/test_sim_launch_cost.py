"""Issue 15 item 8: kernel launches of decoder-layer compute tasks in the simulator's host dispatch cost."""

import dataclasses

import pytest

from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.cost.hardware import HardwareProfile, load_hardware
from lightning_roundpipe.cost.transformer import preset_costs
from lightning_roundpipe.sim import SimConfig, simulate_roundpipe

INF = float("inf")


def hw(launch_s: float, dispatch_s: float = 0.0) -> HardwareProfile:
    """One worker with free transfers and optimizer: only compute and the host's launches take time."""
    return HardwareProfile(name="ideal", num_gpus=1, tflops=1.0, gpu_memory_bytes=10**12, host_device_bytes_per_s=INF,
                           host_memory_bytes=10**12, cpu_optimizer_params_per_s=INF, dispatch_s=dispatch_s,
                           launch_s=launch_s, forward_launches_per_layer=2, backward_launches_per_layer=3)


def costs(forward_s: float, backward_s: float, decoder_layers=(0, 1)) -> CostProfile:
    layer = LayerCost(forward_s, forward_s, backward_s, 100, 100, 10, params=10, trainable_params=10)
    return CostProfile([layer], tokens_per_microbatch=1, decoder_layers=decoder_layers)


FUSED = Plan(1, ((0, 1),), ((0, 1),), fused_last=True)
SPLIT = Plan(1, ((0, 1),), ((0, 1),), fused_last=False)


def step_s(plan, profile, hardware, microbatches=2):
    return simulate_roundpipe(plan, profile, hardware, microbatches, config=SimConfig(steps=4)).step_s


def test_launches_bound_a_step_of_free_computes():
    # A fused task launches 3 kernels per decoder layer, 1 s each on the host; 2 microbatches: 6 s.
    assert step_s(FUSED, costs(0.0, 0.0), hw(1.0)) == pytest.approx(6.0)
    # Forward (2 launches) then recompute + backward (3) per microbatch, no host barrier in the way
    # of computes this free: 2 x (2 + 3) = 10 s.
    assert step_s(SPLIT, costs(0.0, 0.0), hw(1.0), ) == pytest.approx(10.0)
    # Layers outside the decoder range launch nothing here; dispatch_s still counts per task.
    assert step_s(FUSED, costs(0.0, 0.0, decoder_layers=None), hw(1.0)) == pytest.approx(0.0)


def test_launches_hide_behind_long_computes_but_for_the_first():
    # 10 s per fused microbatch: the first compute waits for its 3 s of launches, the second's are
    # issued while the first runs. Step = 3 + 2 x 10 = 23 s (without launches 20 s).
    assert step_s(FUSED, costs(2.5, 7.5), hw(1.0)) == pytest.approx(23.0)
    assert step_s(FUSED, costs(2.5, 7.5), hw(0.0)) == pytest.approx(20.0)


def test_gpu_profiles_carry_the_measured_launch_budget():
    for name in ("rtx4090", "rtx3090", "a100", "h100", "h200"):
        p = load_hardware(name)
        assert (p.launch_s, p.forward_launches_per_layer, p.backward_launches_per_layer) == (1.5e-5, 53, 149)
        assert p.launch_seconds("forward", 4) == pytest.approx(4 * 53 * 1.5e-5)
        assert p.launch_seconds("backward", 2) == p.launch_seconds("fused", 2) == pytest.approx(2 * 149 * 1.5e-5)
    c = preset_costs("qwen3-8b", load_hardware("rtx4090"), 1024)
    assert c.decoder_layers == (1, 37) and len(c.layers) == 38  # embedding, 36 decoder layers, head
    with pytest.raises(ValueError, match="launch_s must not be negative, got -1"):
        dataclasses.replace(hw(1.0), launch_s=-1.0)
