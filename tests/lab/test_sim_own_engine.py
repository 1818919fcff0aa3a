"""The engine's per-call host work in the simulator (hand-computed), and the own-engine comparison."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.cost.hardware import HardwareProfile
from lightning_roundpipe.sim import SimConfig, simulate_roundpipe
from roundpipe_lab.analysis.designs import PricedDesign
from roundpipe_lab.analysis.workload import optimizer_step_period

INF = float("inf")
FUSED = Plan(1, ((0, 1),), ((0, 1),), fused_last=True)
UNFUSED = Plan(1, ((0, 1),), ((0, 1),))


def one_worker(optimizer_params_per_s: float = INF) -> HardwareProfile:
    """Free transfers: only compute, the host optimizer and the host's own work take time."""
    return HardwareProfile(name="ideal", num_gpus=1, tflops=1.0, gpu_memory_bytes=10**12, host_device_bytes_per_s=INF,
                           host_memory_bytes=10**12, cpu_optimizer_params_per_s=optimizer_params_per_s)


def one_layer(forward_s=1.0, backward_s=2.0, grad_bytes=100, trainable=300) -> CostProfile:
    # recompute = forward: an unfused backward takes 1 + 2 = 3 s, a fused microbatch 1 + 2 = 3 s
    layer = LayerCost(forward_s, forward_s, backward_s, 100, grad_bytes, 10, params=trainable, trainable_params=trainable)
    return CostProfile([layer], tokens_per_microbatch=1)


def run(plan, microbatches, hw=None, **config):
    config.setdefault("steps", 1)
    return simulate_roundpipe(plan, one_layer(), hw or one_worker(), microbatches, config=SimConfig(**config))


def main_records(result, kind):
    return [(r.start, r.end) for r in result.timeline if r.queue == "main" and r.kind == kind]


def test_host_loss_sits_between_forward_and_backward_without_a_fused_stage():
    # forward [0, 1], output home at once, the host's loss [1, 3], backward (recompute + backward) [3, 6].
    result = run(UNFUSED, 1, host_loss_s=2.0)
    assert main_records(result, "loss") == [(1.0, 3.0)]
    backward = next(r for r in result.timeline if r.kind == "backward")
    assert (backward.start, backward.end) == (3.0, 6.0)
    assert result.step_s == pytest.approx(6.0)
    assert run(UNFUSED, 1).step_s == pytest.approx(4.0)


def test_fused_loss_sum_delays_the_next_call():
    # Two fused microbatches [0, 3] and [3, 6]; the host sums the loss scalars [6, 8]; backward()
    # returns at 8 and the next call starts there: 8 s per call (6 s without the host's loss).
    two = dict(steps=2, accumulation=2)
    assert run(FUSED, 2, host_loss_s=2.0, **two).step_s == pytest.approx(8.0)
    assert main_records(run(FUSED, 2, host_loss_s=2.0, **two), "loss") == [(6.0, 8.0), (14.0, 16.0)]
    assert run(FUSED, 2, **two).step_s == pytest.approx(6.0)


def test_asynchronous_backward_lets_the_next_call_start_on_the_device():
    # As above, but the next call's tasks are submitted before backward() returns: its first
    # microbatch starts when the worker is free (6 s), not after the host's loss (8 s).
    two = dict(steps=2, accumulation=2, host_loss_s=2.0)
    result = run(FUSED, 2, design=PricedDesign(call_barrier=False), **two)
    assert result.step_s == pytest.approx(6.0)
    second = min(r.start for r in result.timeline if r.step == 1 and r.kind == "fused")
    assert second == 6.0


def test_a_step_barrier_lets_only_the_accumulation_calls_start_before_backward_returns():
    # call_barrier="step" (the engine's overlap_calls): two calls per optimizer step. Call 1 only
    # accumulates after call 0, so it starts when the worker is free (6 s); call 2 opens the next
    # step and waits for call 1's backward() to return: its fused microbatches [6, 9], [9, 12],
    # the host's loss [12, 14]. Call 3 again starts on the free worker (20 s).
    result = run(FUSED, 2, design=PricedDesign(call_barrier="step"), steps=4, accumulation=2, host_loss_s=2.0)
    starts = [min(r.start for r in result.timeline if r.step == s and r.kind == "fused") for s in range(4)]
    assert starts == [0.0, 6.0, 14.0, 20.0]
    every_call = run(FUSED, 2, design=PricedDesign(call_barrier=True), steps=4, accumulation=2, host_loss_s=2.0)
    assert [min(r.start for r in every_call.timeline if r.step == s and r.kind == "fused") for s in range(4)] == \
        [0.0, 8.0, 16.0, 24.0]


def test_gradient_accumulation_on_the_host_gates_the_optimizer_and_the_next_call():
    # Fused microbatches [0, 3], [3, 6]; the 100-byte gradient home at 6; the main thread adds it
    # into .grad at 50 B/s: [6, 8]; the exact optimizer (300 params at 100/s) [8, 11]; the next
    # call's weights wait for that update: 11 s per call. Without the accumulation: 6 + 3 = 9 s.
    hw = one_worker(100.0)
    result = run(FUSED, 2, hw=hw, steps=3, host_accumulate_bytes_per_s=50.0)
    assert optimizer_step_period(result, 1) == pytest.approx(11.0)
    assert main_records(result, "accumulate")[0] == (6.0, 8.0)
    update = next(r for r in result.timeline if r.kind == "optim")
    assert (update.start, update.end) == (8.0, 11.0)
    assert optimizer_step_period(run(FUSED, 2, hw=hw, steps=3), 1) == pytest.approx(9.0)


def test_host_knobs_are_checked():
    with pytest.raises(ValueError, match="host_loss_s must be at least 0"):
        SimConfig(host_loss_s=-1.0)
    with pytest.raises(ValueError, match="host_accumulate_bytes_per_s must be None or positive"):
        SimConfig(host_accumulate_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="launch_s must be None or at least 0"):
        SimConfig(launch_s=-1e-6)


# ----------------------------------------------------------------------------- the comparison


def test_our_default_reads_the_options_and_the_measured_figures():
    from lightning_roundpipe.options import PartitionConfig, RuntimeOptions
    from lightning_roundpipe.cost.hardware import load_hardware
    from roundpipe_lab.analysis.own_engine import ADAM_PER_ACCUMULATE, our_default

    hw = load_hardware("rtx4090")
    ours = our_default(hw)
    assert (ours.precision, ours.staleness) == ("bf16-mixed", 0)
    assert ours.partition == PartitionConfig().policy
    from roundpipe_lab.analysis.own_engine import ENGINE_CHOICE, microbatch_candidates

    assert RuntimeOptions().microbatches is None  # open: the engine chooses among 1, 2 and 4 per worker
    assert ours.microbatches == ENGINE_CHOICE and microbatch_candidates(hw.num_gpus) == [8, 16, 32]
    assert ours.dispatch_s == load_hardware("cpu2").dispatch_s
    assert ours.host_accumulate_bytes_per_s == pytest.approx(hw.cpu_optimizer_params_per_s * ADAM_PER_ACCUMULATE * 2)


def test_setup_simulates_the_reference_rows_sim_config():
    from roundpipe_lab.analysis.own_engine import Setup
    from roundpipe_lab.analysis.workload import Workload

    w = Workload(64, 4, 2)
    cfg = Setup().sim_config(w, 3)
    assert (cfg.steps, cfg.accumulation, cfg.stale_optimizer, cfg.optimizer_barrier) == (6, 2, True, False)
    exact = replace(Setup(), staleness=0, wait_all_grads=True, dispatch_s=1e-4).sim_config(w, 3)
    assert (exact.stale_optimizer, exact.clip_grad_norm, exact.dispatch_s) == (False, True, 1e-4)
    with pytest.raises(ValueError, match=r"precision must be one of \['16-mixed', 'bf16-mixed', 'fp16-acc'\]"):
        Setup(precision="fp8")
    assert cfg.host_barriers is False and cfg.optimizer_undo is False  # the reference: neither
    ours = replace(Setup(), staleness=0, host_barriers=True, undo=True, optimizer_order="layer").sim_config(w, 3)
    assert (ours.host_barriers, ours.optimizer_undo, ours.optimizer_order) == (True, True, "layer")


def test_our_default_runs_under_autograd_with_the_options_undo_and_compile():
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.options import RuntimeOptions
    from roundpipe_lab.analysis.own_engine import default_compiled_layers, our_default

    ours = our_default(load_hardware("rtx4090"))
    assert ours.host_barriers is True  # the next call waits for backward() to return
    assert ours.undo == RuntimeOptions().optimizer_undo
    assert ours.compiled_layers == default_compiled_layers()
    assert RuntimeOptions().compile_layers is None  # the backend's rule: compiled on CUDA where Triton runs
    assert default_compiled_layers() is True
    assert RuntimeOptions().recompute_early_stop is None and ours.early_stop is True  # follows compiled layers


def test_host_limit_tokens_by_hand():
    from roundpipe_lab.analysis.own_engine import host_limit_tokens

    # Two decoder layers (layers 0-1 of a 3-layer profile; layer 2 the head), 10 tokens per
    # microbatch. Plan F 0:2 2:3 (fused) | B 0:2: per microbatch forward of F0 2 x 1 s, the fused
    # head 1 + 2 s, backward of B0 2 x (1 + 2) s: 11 s of device time, 1.1 s per token.
    # Host per microbatch: 3 compute tasks x 4 tasks x 0.5 s, plus launches of the decoder
    # layers: F0 2 layers x 3 launches x 0.25 s, B0 2 x 5 x 0.25 s: 6 + 1.5 + 2.5 = 10 s.
    # With 2 workers: tokens below 2 x 10 / 1.1 = 18.18 leave the workers waiting for the host.
    layer = LayerCost(1.0, 1.0, 2.0, 100, 100, 10)
    costs = CostProfile([layer] * 3, tokens_per_microbatch=10, decoder_layers=(0, 2))
    plan = Plan(3, ((0, 2), (2, 3)), ((0, 2), (2, 3)), fused_last=True)
    hw = one_worker().replace(num_gpus=2, launch_s=0.25, forward_launches_per_layer=3, backward_launches_per_layer=5)
    assert host_limit_tokens(plan, costs, hw, 0.5, 4.0) == pytest.approx(2 * 10.0 / 1.1)


@pytest.mark.slow  # 13 setups simulated, about 15 s: a lab figure (the reference workload), kept out of CI's 15 minutes
@pytest.mark.timeout(300)  # 13 setups simulated; 121 s on the 2-core machine under a load average of 12
def test_waterfall_switches_one_cause_at_a_time_to_our_default():
    from lightning_roundpipe.cost.transformer import ModelShape
    from lightning_roundpipe.cost.hardware import load_hardware
    from roundpipe_lab.analysis.own_engine import Setup, causes, our_default, waterfall
    from roundpipe_lab.analysis.workload import PublishedRun, Workload

    hw = load_hardware("rtx4090")
    tiny = ModelShape("tiny", 256, 768, 4, 2, 64, 4096, 4)
    work = Workload(32, 4, 2, seq_len=256)
    run = PublishedRun(tiny, work, replace(work, optimizer="sync"), 1.0, 1.0)
    rows = waterfall(run, hw, optimizer_steps=2)
    switches = causes(hw, work.microbatches)
    assert [r.cause for r in rows[1:]] == [name for name, _ in switches]
    setup = Setup()
    for row, (_, change) in zip(rows[1:], switches):
        setup = replace(setup, **change)
        assert row.result.setup == setup
    assert setup == our_default(hw)
    for before, row in zip(rows, rows[1:]):
        assert row.delta == pytest.approx(row.result.tokens_per_s - before.result.tokens_per_s)
    # The open microbatch default: the fewest of 8, 16, 32 simulated within the tie tolerance of the fastest.
    from lightning_roundpipe.planning.search import TIE_TOLERANCE
    from roundpipe_lab.analysis.own_engine import simulate_setup

    chosen = next(r for r in rows if r.cause.startswith("microbatches")).result
    tried = {m: simulate_setup(run, hw, replace(chosen.setup, microbatches=m), optimizer_steps=2).tokens_per_s
             for m in (8, 16, 32)}
    assert chosen.microbatches == min(m for m, t in tried.items() if t >= max(tried.values()) / (1 + TIE_TOLERANCE))
    assert chosen.tokens_per_s == tried[chosen.microbatches]
    # Tasks this small (one 256-token sequence per microbatch) wait for one host's dispatch.
    dispatch = next(r for r in rows if r.cause.startswith("host dispatch"))
    assert dispatch.delta < 0 and dispatch.result.tokens_per_s > 0


def test_fused_stage_spread_over_two_workers_runs_its_microbatches_side_by_side():
    # One fused stage, 3 s per microbatch, free transfers. On one worker 2 microbatches take 6 s;
    # spread over 2 workers, microbatch 0 on worker 0 and 1 on worker 1 run at once: 3 s, each
    # worker uploading the weights and sending its own gradient home. 3 microbatches: worker 0
    # runs 0 and 2 (6 s), worker 1 runs 1. The host adds both gradients (100 B at 50 B/s, 2 s
    # each, one after the other): backward() returns at 3 + 2 + 2 = 7 s.
    hw = one_worker().replace(num_gpus=2)
    assert run(FUSED, 2, hw=hw).step_s == pytest.approx(6.0)
    spread = run(FUSED, 2, hw=hw, design=PricedDesign(fused_spread=2))
    assert spread.step_s == pytest.approx(3.0)
    assert sorted(r.worker for r in spread.timeline if r.kind == "wgrad") == [0, 1]
    assert sorted(r.worker for r in spread.timeline if r.kind == "weights") == [0, 1]
    assert [(r.worker, r.microbatch) for r in spread.timeline if r.kind == "fused"] == [(0, 0), (1, 1)]
    assert run(FUSED, 3, hw=hw, design=PricedDesign(fused_spread=2)).step_s == pytest.approx(6.0)
    assert run(FUSED, 2, hw=hw, design=PricedDesign(fused_spread=2), host_accumulate_bytes_per_s=50.0).step_s == pytest.approx(7.0)
    with pytest.raises(ValueError, match="fused_spread must be a positive integer"):
        PricedDesign(fused_spread=0)


@pytest.mark.timeout(120)
def test_exact_gap_causes_add_up_to_the_later_start():
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.transformer import ModelShape
    from roundpipe_lab.analysis.exact_gap import CAUSES, exact_gap
    from roundpipe_lab.analysis.own_engine import Setup
    from roundpipe_lab.analysis.workload import PublishedRun, Workload

    tiny = ModelShape("tiny", 256, 768, 4, 2, 64, 4096, 4)
    work = Workload(32, 4, 2, seq_len=256)
    gap = exact_gap(PublishedRun(tiny, work, replace(work, optimizer="sync"), 1.0, 1.0), load_hardware("rtx4090"), Setup())
    assert list(gap["causes"]) == list(CAUSES)
    assert all(v >= -1e-12 for k, v in gap["causes"].items() if k != "drain")
    assert gap["exact_tokens_per_s"] <= gap["stale_tokens_per_s"]
    # the exact step starts later by the causes' sum; the period grows by at most that
    assert gap["period_difference_s"] <= sum(gap["causes"].values()) + 1e-9


@pytest.mark.timeout(60)
def test_bound_of_an_exact_setup_by_hand():
    """Two workers, one call per step: worker 0 computes 0-4 s, worker 1 1-5 s, the next step's
    first compute at 6 s. Per worker: compute 4, fill 0.5, drain 0.5, idle 0, boundary 1. Against a
    reference at 100 tokens/s with 600 tokens per step (period 6 s): bound 6 / (4 + 1) = 1.2x,
    and at 1.1x fill, drain, idle and boundary may cost 6 / 1.1 - 4 s together."""
    from types import SimpleNamespace

    from roundpipe_lab.analysis.exact_gap import bound, step_breakdown
    from roundpipe_lab.analysis.own_engine import Setup, SetupResult

    def compute(worker, step, start, end):
        return SimpleNamespace(queue="compute", kind="forward", stage="F0", worker=worker, step=step, start=start, end=end)

    timeline = [compute(0, 0, 0.0, 4.0), compute(1, 0, 1.0, 5.0), compute(0, 1, 6.0, 10.0), compute(1, 1, 7.0, 11.0)]
    ours = SetupResult(Setup(), 1, 1, 110.0, call=SimpleNamespace(timeline=timeline))
    reference = SetupResult(Setup(), 1, 1, 100.0)
    parts = step_breakdown(ours)["parts"]
    assert parts == pytest.approx({"compute": 4.0, "fill": 0.5, "drain": 0.5, "idle inside": 0.0, "boundary": 1.0})
    b = bound(reference, ours, tokens_per_step=600.0)
    assert b["reference_period"] == pytest.approx(6.0)
    assert b["bound_ratio"] == pytest.approx(1.2)
    assert b["ratio"] == pytest.approx(1.1)
    assert b["slack_at"] == pytest.approx(6.0 / 1.1 - 4.0)


@pytest.mark.timeout(60)
def test_early_stop_what_if_takes_each_decoder_layers_down_projection_off_its_recompute():
    """A profile with datasheet rates only: hidden 256, MLP width 768, 1,000 tokens. The down projection
    is 2 x 256 x 768 FLOPs per token at the fp32-accumulate rate. The what-if subtracts exactly that from
    each decoder layer's recompute and leaves the embedding, the head, forward and backward alone."""
    from roundpipe_lab.analysis.exact_gap import down_projection_seconds, early_stop_costs
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.transformer import ModelShape, shape_layer_costs

    tiny = ModelShape("tiny", 256, 768, 4, 2, 64, 4096, 4)
    hw = load_hardware("rtx4090")
    rate = (hw.matmul_tflops_fp32_acc or hw.tensor_tflops_fp32_acc) * 1e12
    by_hand = 1000 * 2 * 256 * 768 / rate  # no memory traffic in the work
    assert down_projection_seconds(tiny, 1000, hw) == pytest.approx(by_hand, rel=1e-12)

    costs = shape_layer_costs(tiny, hw, 250, 4)  # 1,000 tokens per microbatch
    assert costs.tokens_per_microbatch == 1000
    adjusted = early_stop_costs(tiny, hw)(costs)
    assert len(adjusted.layers) == len(costs.layers) == 1 + 4 + 1
    for n, (before, after) in enumerate(zip(costs.layers, adjusted.layers)):
        assert (after.forward_s, after.backward_s) == (before.forward_s, before.backward_s)
        expected = before.recompute_s - by_hand if 1 <= n <= 4 else before.recompute_s
        assert after.recompute_s == pytest.approx(expected, rel=1e-12)
    assert 0.0 < by_hand < costs.layers[1].recompute_s


@pytest.mark.timeout(120)
def test_simulate_setup_prices_adjusted_costs():
    """``adjust_costs`` reaches the simulation: identity changes nothing; on a plan that does not depend on
    the costs (``uniform``), a recompute at half the price takes exactly that off the backward computes."""
    from roundpipe_lab.analysis.own_engine import Setup, simulate_setup
    from roundpipe_lab.analysis.workload import PublishedRun, Workload
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.transformer import ModelShape

    tiny = ModelShape("tiny", 256, 768, 4, 2, 64, 4096, 4)
    work = Workload(32, 4, 2, seq_len=256)
    run = PublishedRun(tiny, work, replace(work, optimizer="sync"), 1.0, 1.0)
    hw = load_hardware("rtx4090")
    setup = Setup(microbatches=4, partition="uniform", launch_s=0.0)  # no launch floor under the computes
    seen = []

    def identity(costs):
        seen.append(costs)
        return costs

    def halved(costs):
        return replace(costs, layers=[replace(l, recompute_s=l.recompute_s / 2) for l in costs.layers])

    base = simulate_setup(run, hw, setup, optimizer_steps=2)
    same = simulate_setup(run, hw, setup, optimizer_steps=2, adjust_costs=identity)
    faster = simulate_setup(run, hw, setup, optimizer_steps=2, adjust_costs=halved)
    assert [c.tokens_per_microbatch for c in seen] == [32 * 256 // (2 * 4)]
    assert same.tokens_per_s == pytest.approx(base.tokens_per_s, rel=1e-12)
    assert faster.plan.to_text() == base.plan.to_text()
    assert faster.tokens_per_s >= base.tokens_per_s * (1 - 1e-12)  # this tiny step is bound by its transfers

    def busy(result):
        return sum(r.end - r.start for r in result.call.timeline if r.queue == "compute" and r.kind == "backward")

    costs = seen[0]  # as priced for the setup (its precision's matmul rate)
    fused = base.plan.forward[-1]
    recomputed = [l for s, e in base.plan.backward if (s, e) != tuple(fused) for l in range(s, e)]
    per_call = 4 * sum(costs.layers[l].recompute_s for l in recomputed) / 2
    calls = {r.step for r in base.call.timeline}
    assert busy(base) - busy(faster) == pytest.approx(per_call * len(calls), rel=1e-6)


@pytest.mark.timeout(60)
def test_the_early_stopping_recompute_prices_the_down_projection_on_each_backward_stages_last_layer():
    """``shape_layer_costs(early_stop=True)``: each decoder layer's ``early_stop_s`` is its down projection
    (hidden 256 x MLP 768 x 2 FLOPs per token, 1,000 tokens, at the fp32-accumulate rate), the embedding and the
    head none, and nothing else changes. A stage's recompute and backward then lose the last layer's share only."""
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.transformer import ModelShape, shape_layer_costs
    from lightning_roundpipe.cost.view import CostView

    tiny = ModelShape("tiny", 256, 768, 4, 2, 64, 4096, 4)
    hw = load_hardware("rtx4090")
    rate = (hw.matmul_tflops_fp32_acc or hw.tensor_tflops_fp32_acc) * 1e12
    by_hand = 1000 * 2 * 256 * 768 / rate
    plain, stopping = shape_layer_costs(tiny, hw, 250, 4), shape_layer_costs(tiny, hw, 250, 4, early_stop=True)
    assert [c.early_stop_s for c in plain.layers] == [0.0] * 6
    assert [c.early_stop_s for c in stopping.layers] == pytest.approx([0.0] + [by_hand] * 4 + [0.0], rel=1e-12)
    for before, after in zip(plain.layers, stopping.layers):
        assert (after.forward_s, after.recompute_s, after.backward_s) == (before.forward_s, before.recompute_s,
                                                                          before.backward_s)
    p, s = CostView(plain), CostView(stopping)
    assert s.backward_with_recompute_s(1, 4) == pytest.approx(p.backward_with_recompute_s(1, 4) - by_hand, rel=1e-12)
    assert s.backward_with_recompute_s(0, 1) == p.backward_with_recompute_s(0, 1)  # the embedding stops nothing
    assert s.early_stop_s(1, 3) == pytest.approx(2 * by_hand, rel=1e-12)  # layer grain: every layer but the last
    assert stopping.layers[1].scaled(2.0).early_stop_s == pytest.approx(2 * by_hand, rel=1e-12)


@pytest.mark.timeout(60)
def test_the_planner_prices_the_early_stop_as_the_simulator_does():
    """``StageCostModel`` (what the ``auto`` and ``compute`` searches price plans with): a backward stage's
    compute is ``CostView.backward_with_recompute_s``, its last decoder layer's down projection less with
    ``early_stop``; forward and fused stages are unchanged, and without recompute nothing is subtracted."""
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.profile import StageCostModel
    from lightning_roundpipe.cost.transformer import ModelShape, shape_layer_costs
    from lightning_roundpipe.cost.view import CostView

    tiny = ModelShape("tiny", 256, 768, 4, 2, 64, 4096, 4)
    hw = load_hardware("rtx4090")
    plain, stopping = shape_layer_costs(tiny, hw, 250, 4), shape_layer_costs(tiny, hw, 250, 4, early_stop=True)
    down = stopping.layers[1].early_stop_s
    assert down > 0
    p, s = StageCostModel(plain, 4), StageCostModel(stopping, 4)
    for a, b in ((1, 2), (1, 4), (0, 3)):
        assert s.stage("backward", a, b).microbatch_compute_s == pytest.approx(
            CostView(stopping).backward_with_recompute_s(a, b), rel=1e-12)
        assert s.stage("backward", a, b).microbatch_compute_s == pytest.approx(
            p.stage("backward", a, b).microbatch_compute_s - down, rel=1e-12)
    assert s.stage("backward", 4, 6).microbatch_compute_s == p.stage("backward", 4, 6).microbatch_compute_s  # head
    for kind in ("forward", "fused"):
        assert s.stage(kind, 1, 4).microbatch_compute_s == p.stage(kind, 1, 4).microbatch_compute_s
    kept = StageCostModel(stopping, 4, recompute=False).stage("backward", 1, 4).microbatch_compute_s
    assert kept == pytest.approx(sum(c.backward_s for c in stopping.layers[1:4]), rel=1e-12)


@pytest.mark.timeout(120)
def test_the_simulated_backward_computes_stop_early_by_the_priced_seconds():
    """One backward compute of a plan of stages [0,3) [3,6): with early stop, a stage-grain backward task lasts
    ``early_stop_s`` of its last layer less; a layer-grain one that of every layer (its pass without grad
    unchanged)."""
    from dataclasses import replace as dc_replace

    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.transformer import ModelShape, shape_layer_costs
    from lightning_roundpipe.schedule.plan import Plan
    from lightning_roundpipe.sim.simulate import SimConfig, simulate_roundpipe

    tiny = ModelShape("tiny", 256, 768, 4, 2, 64, 4096, 4)
    hw = load_hardware("rtx4090")
    plan = Plan(6, ((0, 3), (3, 6)), ((0, 3), (3, 6))).validate()

    def backward_seconds(early_stop, layer_recompute):
        costs = shape_layer_costs(tiny, hw, 250, 4, early_stop=early_stop)
        res = simulate_roundpipe(plan, costs, hw, 2, config=dc_replace(SimConfig(), layer_recompute=layer_recompute))
        return {r.stage: r.end - r.start for r in res.timeline if r.kind == "backward" and r.microbatch == 0}

    down = shape_layer_costs(tiny, hw, 250, 4, early_stop=True).layers[1].early_stop_s
    plain, stopped = backward_seconds(False, False), backward_seconds(True, False)
    assert stopped["B0"] == pytest.approx(plain["B0"] - down, rel=1e-9)  # last layer 2: a decoder layer
    assert stopped["B1"] == pytest.approx(plain["B1"], rel=1e-9)  # last layer 5: the head, priced as stopping nothing
    plain, stopped = backward_seconds(False, True), backward_seconds(True, True)
    assert stopped["B0"] == pytest.approx(plain["B0"] - 2 * down, rel=1e-9)  # layers 1 and 2 (0: the embedding)
    assert stopped["B1"] == pytest.approx(plain["B1"] - 2 * down, rel=1e-9)  # layers 3 and 4 (5: the head)


def test_an_early_stopping_setup_needs_compiled_layers():
    from roundpipe_lab.analysis.own_engine import Setup

    with pytest.raises(ValueError, match="early_stop is a compiled graph: it needs compiled_layers=True"):
        Setup(early_stop=True)
    assert Setup(early_stop=True, compiled_layers=True).early_stop
