"""The failed-step undo's copy, priced in the simulator (``SimConfig.optimizer_undo``) by hand."""

import pytest

from lightning_roundpipe.cost.hardware import HardwareProfile
from lightning_roundpipe.cost.host_update import unscale_seconds
from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.sim.simulate import SimConfig, simulate_roundpipe, undo_seconds


def _costs():
    # two layers of 1,000 trainable parameters; compute of 1 ms forward and recompute, 2 ms backward
    layer = lambda: LayerCost(1e-3, 1e-3, 2e-3, 4000, 4000, 10, params=1000, trainable_params=1000)  # noqa: E731
    return CostProfile([layer(), layer()], tokens_per_microbatch=10, dtype_bytes=4, input_bytes_per_token=8)


# 1e5 parameters per second: an update of one layer takes 10 ms; without a host bandwidth the copy
# runs at the bandwidth that rate implies, 1e5 x 40 B/s, so 1,000 x 24 B take 6 ms.
HW = HardwareProfile("hand", 1, 1.0, 2**30, 1e9, 2**30, 1e5)


def _run(undo):
    plan = Plan(2, ((0, 1), (1, 2)), ((0, 1), (1, 2)))
    return simulate_roundpipe(plan, _costs(), HW, 1, num_workers=1, config=SimConfig(steps=2, optimizer_undo=undo))


@pytest.mark.timeout(30)
def test_undo_copy_by_hand():
    assert undo_seconds(1000, HW) == pytest.approx(1000 * 24 / (1e5 * 40))
    with_bandwidth = HardwareProfile("hand", 1, 1.0, 2**30, 1e9, 2**30, 1e5, host_memory_bytes_per_s=1.2e6)
    assert undo_seconds(1000, with_bandwidth) == pytest.approx(0.02)  # 24,000 B at 1.2 MB/s

    off, on = _run(False), _run(True)
    assert not [r for r in off.timeline if r.kind == "undo"]
    undo = {(r.step, r.stage): r for r in on.timeline if r.kind == "undo"}
    optim = {(r.step, r.stage): r for r in on.timeline if r.kind == "optim"}
    assert sorted(undo) == sorted(optim) == [(s, f"L{l}") for s in (0, 1) for l in (0, 1)]
    for key, copy in undo.items():
        assert copy.duration == pytest.approx(6e-3)
        assert optim[key].duration == pytest.approx(10e-3)
        assert optim[key].start >= copy.end - 1e-12  # the update waits for its layer's copy
    for layer in ("L0", "L1"):
        assert undo[(1, layer)].start >= optim[(0, layer)].end - 1e-12  # the copy is of the updated layer
    # Step 0's copies run while the workers compute (idle host time): they start at 0.
    assert min(undo[(0, l)].start for l in ("L0", "L1")) == 0.0
    # One worker: F0, F1 (1 ms each), B1 and B0 (3 ms each). Without undo, L1's update starts when B1's
    # gradient is home (5.0126 ms after the step's start) and the two 10 ms updates end the step.
    assert off.step_s == pytest.approx(5.0126e-3 + 20e-3)
    # With undo the host never idles: L1's copy runs during the forward (0-6 ms), its update
    # (6-16 ms) goes before L0's copy (16-22 ms; idle work yields), then L0's update: 2 x 6 + 2 x 10 ms.
    assert on.step_s == pytest.approx(32e-3)
    assert (undo[(0, "L0")].start, undo[(0, "L1")].start) == pytest.approx((16e-3, 0.0))


@pytest.mark.timeout(30)
def test_loss_scaled_steps_by_hand():
    """fp16's loss scaler: with the undo, layers step early as in bf16 (the undo puts them back on overflow);
    without it, every gradient is checked before any layer steps."""
    from roundpipe_lab.analysis.precision import waits_for_every_gradient

    assert not waits_for_every_gradient("fp16-acc", undo=True) and waits_for_every_gradient("16-mixed", undo=False)
    assert not waits_for_every_gradient("bf16-mixed", undo=False)
    plan = Plan(2, ((0, 1), (1, 2)), ((0, 1), (1, 2)))

    def step(undo):
        config = SimConfig(steps=2, optimizer_undo=undo, clip_grad_norm=waits_for_every_gradient("fp16-acc", undo))
        return simulate_roundpipe(plan, _costs(), HW, 1, num_workers=1, config=config)

    early, waiting = step(True), step(False)
    assert early.step_s == pytest.approx(_run(True).step_s) == pytest.approx(32e-3)  # as test_undo_copy_by_hand
    # Without the undo L1's update waits for B0's gradient too (home at 8.0127 ms: 2 x 1 ms forward, 2 x 3 ms
    # backward, the download), then the two 10 ms updates run one after the other.
    optim = {r.stage: r for r in waiting.timeline if r.kind == "optim" and r.step == 0}
    assert optim["L1"].start == pytest.approx(8.0128e-3, abs=1e-6) and optim["L0"].start == pytest.approx(optim["L1"].end)
    assert waiting.step_s == pytest.approx(8.0127e-3 + 20e-3, abs=1e-6)
    # Each update first unscales its fp32 gradient: 1,000 x 8 B read and written at 1e5 x 40 B/s, 2 ms.
    assert unscale_seconds(1000, HW) == pytest.approx(2e-3)
    config = SimConfig(steps=2, optimizer_undo=True, host_unscale=True)
    unscaled = simulate_roundpipe(plan, _costs(), HW, 1, num_workers=1, config=config)
    assert [r.duration for r in unscaled.timeline if r.kind == "optim"] == pytest.approx([12e-3] * 4)
    assert unscaled.step_s == pytest.approx(2 * 6e-3 + 2 * 12e-3)  # the host never idles, as with the undo alone


@pytest.mark.timeout(30)
def test_undo_journal_by_hand():
    """A journal of one layer's before-image (1,000 x 12 B): L1 (its gradient home first) is journaled as
    before; L0 is past it, takes no copy, and its update waits for every gradient of the step."""
    plan = Plan(2, ((0, 1), (1, 2)), ((0, 1), (1, 2)))
    config = SimConfig(steps=2, optimizer_undo=True, undo_journal_bytes=12_000)
    res = simulate_roundpipe(plan, _costs(), HW, 1, num_workers=1, config=config)
    assert sorted((r.step, r.stage) for r in res.timeline if r.kind == "undo") == [(0, "L1"), (1, "L1")]
    # One worker: L1's copy (0-6 ms) runs during the forward, its update as B1's gradient is home (5.0126 ms)
    # once the copy is done (6-16 ms); L0's update starts after both gradients are home and L1's update: 16-26 ms.
    assert res.step_s == pytest.approx(26e-3)
    assert simulate_roundpipe(plan, _costs(), HW, 1, num_workers=1, config=SimConfig(
        steps=2, optimizer_undo=True, undo_journal_bytes=None)).step_s == pytest.approx(_run(True).step_s)
