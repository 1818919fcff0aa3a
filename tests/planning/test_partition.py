"""Partition policies, the timing model, cost estimates and re-planning, on synthetic costs."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.cost.estimate import MovingCostProfile, cost_change, estimate_costs
from lightning_roundpipe.planning.partition import TIE_TOLERANCE, partition, predict
from lightning_roundpipe.planning.replan import Replanner
from lightning_roundpipe.schedule.plan import Plan, PlanError

MiB = 2**20
GiB = 2**30
LINK = 25e9  # PCIe 4.0 x16, one direction


def layer(forward_s: float, weight_bytes: int = 100_000_000, act_bytes_per_token: int = 8192) -> LayerCost:
    return LayerCost(forward_s, forward_s, 2 * forward_s, weight_bytes, weight_bytes, act_bytes_per_token)


def profile(layers: list[LayerCost], tokens: int = 2048) -> CostProfile:
    return CostProfile(layers, tokens_per_microbatch=tokens)


def equal_layers(n: int = 16) -> CostProfile:
    return profile([layer(0.01) for _ in range(n)])


def lm_head_heavy() -> CostProfile:
    """12 decoder layers and an LM head costing three of them."""
    return profile([layer(0.01) for _ in range(12)] + [layer(0.03, weight_bytes=300_000_000)])


def sizes(ranges) -> list[int]:
    return [b - a for a, b in ranges]


def seconds_of(plan: Plan, prefix: str) -> list[float]:
    return [s for name, s in plan.facts.stage_seconds.items() if name.startswith(prefix)]


# --------------------------------------------------------------------- timing model
def test_predict_single_worker_is_serial_and_has_no_bubble():
    costs = profile([layer(1.0, 0, 0), layer(2.0, 0, 0)])
    plan = Plan(2, ((0, 1), (1, 2)), ((0, 1), (1, 2)))
    p = predict(plan, costs, num_workers=1, microbatches=2, stage_overhead_s=0.0)
    # forward 2 * (1 + 2), then backward 2 * (3 + 6)
    assert p.step_s == pytest.approx(24.0)
    assert p.forward_s == pytest.approx(6.0)
    assert p.bubble == pytest.approx(0.0)
    assert p.stage_seconds == pytest.approx({"F0": 2.0, "F1": 4.0, "B1": 12.0, "B0": 6.0})


def test_predict_two_workers_pipelines_microbatches():
    costs = profile([layer(1.0, 0, 0), layer(2.0, 0, 0)])
    plan = Plan(2, ((0, 1), (1, 2)), ((0, 1), (1, 2)))
    p = predict(plan, costs, num_workers=2, microbatches=2, stage_overhead_s=0.0)
    # F0 on w0: 0-1, 1-2; F1 on w1: 1-3, 3-5; B1 on w0 after the forward: 5-11, 11-17; B0 on w1: 11-14, 17-20
    assert p.forward_s == pytest.approx(5.0)
    assert p.step_s == pytest.approx(20.0)
    assert p.bubble == pytest.approx(1 - 24 / 40)


def test_predict_exposes_weight_upload_of_first_stage():
    costs = profile([LayerCost(1.0, 1.0, 2.0, 2_000, 0, 0)])
    plan = Plan(1, ((0, 1),), ((0, 1),))
    p = predict(plan, costs, 1, 1, link_bytes_per_second=1_000.0, stage_overhead_s=0.0)
    # 2 s to upload the weights, 1 s forward; the backward's upload is prefetched from its
    # predecessor's start (t=2) and ready at 4 > 3, so it waits 1 s, then runs 3 s
    assert p.step_s == pytest.approx(7.0)


# --------------------------------------------------------------------- simple policies
def test_uniform_and_params_policies_for_equal_layers():
    costs = equal_layers(16)
    for policy in ("uniform", "params"):
        plan = partition(policy, costs, num_workers=4, microbatches=8)
        assert sizes(plan.forward) == [4, 4, 4, 4]
        assert sizes(plan.backward) == [2] * 8
        assert plan.facts.policy == policy
        assert plan.facts.predicted_step_s > 0
        assert set(plan.facts.stage_seconds) == {f"F{i}" for i in range(4)} | {f"B{i}" for i in range(8)}


def test_params_policy_balances_weight_bytes():
    costs = profile([layer(0.01, weight_bytes=w) for w in (1, 1, 1, 1, 4)])
    plan = partition("params", costs, num_workers=2, microbatches=4, recompute=False)
    assert plan.forward == ((0, 4), (4, 5))
    assert plan.backward == plan.forward


# --------------------------------------------------------------------- auto policy
def test_auto_on_equal_layers_beats_equal_cuts_and_is_annotated():
    costs = equal_layers(16)
    plan = partition("auto", costs, num_workers=4, microbatches=8, link_bytes_per_second=LINK)
    uniform = partition("uniform", costs, num_workers=4, microbatches=8, link_bytes_per_second=LINK)
    assert plan.facts.predicted_step_s < uniform.facts.predicted_step_s
    # small first stages: the second worker starts sooner (the pipeline fills faster)
    assert plan.forward[0][1] - plan.forward[0][0] <= uniform.forward[0][1] - uniform.forward[0][0]
    assert plan.facts.policy == "auto"
    assert 0.0 <= plan.facts.predicted_bubble < 1.0


def _compositions(start: int, end: int):
    n = end - start
    for mask in range(1 << max(n - 1, 0)):
        bounds = [start] + [start + i + 1 for i in range(n - 1) if mask >> i & 1] + [end]
        yield tuple((bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1))


def _every_plan(n: int, fused: bool, recompute: bool):
    for forward in _compositions(0, n):
        if not recompute:
            yield Plan(n, forward, forward, fused_last=fused)
        elif fused:
            h = forward[-1][0]
            for inner in (_compositions(0, h) if h else [()]):
                yield Plan(n, forward, tuple(inner) + (forward[-1],), fused_last=True)
        else:
            for backward in _compositions(0, n):
                yield Plan(n, forward, backward)


def head_heavy_small() -> CostProfile:
    return profile([layer(0.01) for _ in range(6)] + [layer(0.03, weight_bytes=300_000_000)])


# With recompute the backward is cut on its own: 4,096 plans priced per case, 1.5-4 s each on 2 quiet cores.
# The 3-worker ones of those check the same search as the 2-worker ones and run in the slow run.
EXHAUSTIVE_CASES = [pytest.param(workers, microbatches, fused, recompute,
                                 marks=[pytest.mark.slow] if workers == 3 and recompute else [])
                    for workers, microbatches in ((2, 4), (3, 6))
                    for fused, recompute in ((True, True), (True, False), (False, True), (False, False))]


@pytest.mark.parametrize("costs", [head_heavy_small, lambda: equal_layers(7),
                                   lambda: profile([layer(0.01 * (1 + i % 3)) for i in range(7)])])
@pytest.mark.parametrize("workers,microbatches,fused,recompute", EXHAUSTIVE_CASES)
def test_auto_finds_the_fastest_plan_of_a_small_model(costs, workers, microbatches, fused, recompute):
    """Against every plan of a 7-layer model (searched exhaustively): the pick is the plan with the
    fewest stages among those within TIE_TOLERANCE of the optimum."""
    c = costs()
    plan = partition("auto", c, workers, microbatches, link_bytes_per_second=LINK, fused_last=fused, recompute=recompute)
    priced = [(predict(p, c, workers, microbatches, link_bytes_per_second=LINK, recompute=recompute).step_s, p)
              for p in _every_plan(7, fused, recompute)]
    best = min(s for s, _ in priced)
    got = plan.facts.predicted_step_s
    assert best * (1 - 1e-9) <= got <= best * (1 + TIE_TOLERANCE) + 1e-12
    stages = lambda p: len(p.forward) + len(p.backward)  # noqa: E731
    fewest = min(stages(p) for s, p in priced if s <= best * (1 + TIE_TOLERANCE))
    assert stages(plan) == fewest


def test_auto_plan_for_two_workers_is_stable():
    plan = partition("auto", equal_layers(16), 2, 8, link_bytes_per_second=LINK)
    assert plan.to_text() == "F 0:1 1:8 8:15 15:16 | B 0:2 2:4 4:6 6:8 8:10 10:12 12:14 14:16"


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("workers,microbatches", [(2, 8), (4, 8), (4, 32), (8, 16)])
def test_auto_is_never_predicted_slower_than_balanced_cuts(workers, microbatches, fused):
    """The search starts from min-max balanced cuts, so it can only be faster than them (and
    than the uniform and params policies); the head is never lumped with many decoder layers."""
    c = lm_head_heavy()
    kw = dict(link_bytes_per_second=LINK, fused_last=fused)
    plan = partition("auto", c, workers, microbatches, **kw)
    for policy in ("uniform", "params"):
        other = partition(policy, c, workers, microbatches, **kw)
        assert plan.facts.predicted_step_s <= other.facts.predicted_step_s * (1 + 1e-9), (policy, other)
    assert plan.forward[-1][1] - plan.forward[-1][0] <= 2


def test_auto_fused_last_stage_is_last_in_both_directions():
    plan = partition("auto", lm_head_heavy(), 4, 8, link_bytes_per_second=LINK, fused_last=True)
    assert plan.fused_last and plan.forward[-1] == plan.backward[-1]
    fused = plan.fused_stage
    assert fused == f"F{len(plan.forward) - 1}"
    # the fused stage is not dispatched a second time as a backward stage
    assert f"B{len(plan.backward) - 1}" not in plan.facts.stage_seconds


def test_fused_runs_start_backward_per_microbatch():
    """Without a fused stage backward waits for the whole forward; with one, each backward
    microbatch waits only for its own gradient (the engine dispatches backward right after it)."""
    c = profile([layer(0.01), layer(0.01)])
    plain = Plan.from_text("F 0:1 1:2 | B 0:1 1:2")
    fused = Plan.from_text("F 0:1 1:2 | B 0:1 1:2 | fused")
    # 2 workers, 2 microbatches, free links, no overhead. Forward 0.01, fused 0.03, backward 0.03.
    # Plain: F0 w0 [0, .02], F1 w1 [.01, .03]; B1 w0 waits for the forward: [.03, .09]; B0 w1 [.06, .12].
    t_plain = predict(plain, c, 2, 2, stage_overhead_s=0.0).step_s
    # Fused: F0 w0 [0, .02]; fused w1 mb0 [.01, .04], mb1 [.04, .07]; B0 w0 mb0 [.04, .07], mb1 [.07, .10].
    t_fused = predict(fused, c, 2, 2, stage_overhead_s=0.0).step_s
    assert t_plain == pytest.approx(0.12) and t_fused == pytest.approx(0.10)


def test_auto_without_recompute_uses_forward_cuts_for_backward():
    plan = partition("auto", equal_layers(12), 4, 8, recompute=False)
    assert plan.same_cuts()


def test_auto_respects_memory_budget():
    costs = equal_layers(16)  # 100 MB of weights and 100 MB of gradients per layer
    budget = 600 * MiB
    free = partition("auto", costs, 2, 8, link_bytes_per_second=LINK)
    assert max(free.facts.stage_memory_bytes.values()) > budget / 2  # the budget binds
    plan = partition("auto", costs, 2, 8, link_bytes_per_second=LINK, memory_budget_bytes=budget)
    for name, (a, b) in [(f"F{i}", r) for i, r in enumerate(plan.forward)] + [
        (f"B{i}", r) for i, r in enumerate(plan.backward)
    ]:
        weights = sum(c.weight_bytes for c in costs.layers[a:b])
        assert weights <= budget / 2, name
        assert plan.facts.stage_memory_bytes[name] <= budget / 2, name
    assert plan.facts.memory_budget_bytes == budget
    assert max(sizes(plan.forward)) == 2 and max(sizes(plan.backward)) == 1  # 3 or 2 layers would not fit


def test_layer_too_large_for_budget_names_layer_size_and_budget():
    layers = [layer(0.01) for _ in range(6)]
    layers[4] = LayerCost(0.01, 0.01, 0.02, 2 * GiB, 0, 0)
    with pytest.raises(PlanError) as info:
        partition("auto", profile(layers), 4, 8, memory_budget_bytes=1 * GiB)
    message = str(info.value)
    # weights plus the 16 MiB input of one microbatch (2048 tokens x 8192 bytes from layer 3)
    assert message.startswith("layer 4 needs 2.02 GiB (2164260864 bytes: weights 2.00 GiB, weight gradients 0 B")
    assert "1.00 GiB (1073741824 bytes)" in message
    assert "512.00 MiB (536870912 bytes)" in message
    assert "Raise memory_budget_bytes" in message


def test_simple_policy_stage_over_budget_is_reported():
    with pytest.raises(PlanError, match=r"stage F0\[0:8\] needs 778.94 MiB \(816777216 bytes\) .* budget of 1.00 GiB"):
        partition("uniform", equal_layers(16), 2, 8, memory_budget_bytes=1 * GiB, recompute=False)


# --------------------------------------------------------------------- manual policy
def test_manual_plan_is_validated_and_annotated():
    plan = partition("manual", equal_layers(6), 2, 4, manual_forward=[[0, 3], [3, 6]], manual_backward=[[0, 2], [2, 4], [4, 6]])
    assert plan.to_text() == "F 0:3 3:6 | B 0:2 2:4 4:6"
    assert plan.facts.policy == "manual"
    assert sorted(plan.facts.stage_seconds) == ["B0", "B1", "B2", "F0", "F1"]
    same = partition("manual", equal_layers(6), 2, 4, manual_forward=[[0, 3], [3, 6]])
    assert same.backward == same.forward


@pytest.mark.parametrize(
    "forward,message",
    [
        ([[0, 3], [4, 6]], "forward stage 1 [4:6] leaves a gap: it must start at layer 3 (layers 3..3 are in no stage)"),
        ([[0, 3], [2, 6]], "forward stage 1 [2:6] overlaps the previous stage: it must start at layer 3"),
        ([[0, 3], [3, 3], [3, 6]], "forward stage 1 [3:3] is empty"),
        ([], "the plan has no forward stages"),
        ([[0, 3]], "forward stages end at layer 3 but the model has 6 layers"),
        ([[0, 3], [3]], "manual_forward entry [3] is not a [start, end] pair"),
    ],
)
def test_manual_plan_errors(forward, message):
    with pytest.raises(PlanError) as info:
        partition("manual", equal_layers(6), 2, 4, manual_forward=forward)
    assert message in str(info.value)


def test_manual_without_recompute_needs_equal_cuts():
    with pytest.raises(PlanError, match=r"recompute=False keeps the forward graph.*\[\[0, 3\], \[3, 6\]\].*\[\[0, 2\], \[2, 6\]\]"):
        partition("manual", equal_layers(6), 2, 4, recompute=False, manual_forward=[[0, 3], [3, 6]], manual_backward=[[0, 2], [2, 6]])


def test_manual_needs_ranges_and_policy_must_be_known():
    with pytest.raises(PlanError, match="the manual policy needs manual_forward"):
        partition("manual", equal_layers(6), 2, 4)
    with pytest.raises(PlanError, match="unknown partition policy 'fastest'"):
        partition("fastest", equal_layers(6), 2, 4)
    with pytest.raises(PlanError, match="num_workers must be at least 1"):
        partition("auto", equal_layers(6), 0, 4)


def test_manual_fused_last_must_end_both_directions_alike():
    with pytest.raises(PlanError, match="a fused last stage runs forward and backward of the same layers"):
        partition("manual", equal_layers(6), 2, 4, fused_last=True, manual_forward=[[0, 3], [3, 6]], manual_backward=[[0, 4], [4, 6]])


# --------------------------------------------------------------------- estimates
def test_estimate_costs_from_module_sizes():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)
            self.register_buffer("scale", torch.ones(16, dtype=torch.float32))

    embedding, frozen = nn.Embedding(100, 16), nn.Linear(16, 100, bias=False)
    frozen.weight.requires_grad_(False)
    costs = estimate_costs([embedding, WithBuffer(), frozen], 8, None, torch.bfloat16, flops_per_second=1e9)
    emb, mid, head = costs.layers
    assert emb.forward_s == pytest.approx(16 * 8 / 1e9)  # lookup: one FLOP per output element only
    assert mid.forward_s == pytest.approx((2 * 272 * 8 + 16 * 8) / 1e9)
    assert mid.recompute_s == mid.forward_s and mid.backward_s == pytest.approx(2 * mid.forward_s)
    # bf16-mixed (cost/autocast_cast.py): the embedding stays fp32; Linear weights travel in bf16 and,
    # trainable, are held as fp32 leaves plus autocast's bf16 copy; gradients are fp32; a frozen Linear stays bf16.
    assert (emb.weight_bytes, emb.device_weight_bytes, emb.grad_bytes) == (1600 * 4, 1600 * 4, 1600 * 4)
    assert mid.weight_bytes == 272 * 2 + 16 * 4  # buffer in its own dtype
    assert mid.device_weight_bytes == 272 * (4 + 2) + 16 * 4
    assert (head.weight_bytes, head.device_weight_bytes) == (1600 * 2, 1600 * 2)
    assert head.grad_bytes == 0 and mid.grad_bytes == 272 * 4
    assert [c.act_bytes_per_token for c in costs.layers] == [32, 32, 200]
    assert [c.active_params for c in costs.layers] == [c.params for c in costs.layers] == [1600, 272, 1600]
    assert costs.tokens_per_microbatch == 8 and not costs.measured
    fixed = estimate_costs([embedding, frozen], 8, 4096, torch.float32, link_bytes_per_second=1e9)
    assert [c.act_bytes_per_token for c in fixed.layers] == [4096, 4096]
    assert fixed.link_bytes_per_second == 1e9


def test_moving_profile_first_measurement_replaces_then_averages():
    moving = MovingCostProfile(profile([layer(1.0), layer(3.0)]), smoothing=0.5)
    moving.observe(0, "forward", 2.0)
    assert moving.profile().layers[0].forward_s == 2.0
    moving.observe(0, "forward", 4.0)
    assert moving.profile().layers[0].forward_s == 3.0
    moving.observe_stage((0, 2), "backward", 16.0, microbatches=2)  # 8 s per microbatch, estimates 2 : 6
    snapshot = moving.profile()
    assert [c.backward_s for c in snapshot.layers] == [2.0, 6.0]
    assert snapshot.measured and snapshot.source == "measured"
    moving.observe_stage(range(1, 2), "fused", 12.0)  # forward 3 : backward 6 -> 4 and 8, averaged in
    layer1 = moving.profile().layers[1]
    assert (layer1.forward_s, layer1.backward_s) == (4.0, 7.0)
    with pytest.raises(ValueError, match="unknown time kind 'sideways'"):
        moving.observe(0, "sideways", 1.0)
    with pytest.raises(IndexError, match="layer index 5 is outside the model's 2 layers"):
        moving.observe(5, "forward", 1.0)


def test_moved_since_compares_stage_totals():
    base = equal_layers(4)
    plan = Plan(4, ((0, 2), (2, 4)), ((0, 2), (2, 4)))
    moving = MovingCostProfile(base)
    moving.observe(3, "forward", 0.012)  # F1 0.02 -> 0.022: 10%
    assert not moving.moved_since(base, 0.2, plan)
    moving.observe(3, "forward", 0.032)  # EMA 0.012 -> 0.018: F1 0.028, 40%
    assert moving.moved_since(base, 0.2, plan)
    change, where = cost_change(base, moving.profile(), plan)
    assert change == pytest.approx(0.4) and where.startswith("stage F1")


# --------------------------------------------------------------------- re-planning
def test_replanner_replans_only_above_threshold(caplog):
    costs = equal_layers(16)
    plan = partition("auto", costs, 2, 8, link_bytes_per_second=LINK)
    replanner = Replanner(plan, costs, 2, 8, threshold=0.2, link_bytes_per_second=LINK)
    nudged = profile([layer(0.011 if i == 15 else 0.01) for i in range(16)])
    with caplog.at_level(logging.INFO, logger="lightning_roundpipe"):
        assert replanner.maybe_replan(nudged) is None
    assert not caplog.records and replanner.plan is plan
    # the last four layers become ten times as slow (an LM head-like tail)
    heavy = profile([layer(0.1 if i >= 12 else 0.01) for i in range(16)])
    with caplog.at_level(logging.INFO, logger="lightning_roundpipe"):
        new_plan = replanner.maybe_replan(heavy)
    assert new_plan is not None and new_plan.to_text() != plan.to_text()
    assert replanner.plan is new_plan and replanner.costs is heavy
    (record,) = caplog.records
    assert "re-planned because stage B7 (0.06s -> 0.6s per microbatch) changed by 900% (threshold 20%)" in record.getMessage()
    assert replanner.maybe_replan(heavy) is None  # compared against the new baseline now


def test_replanner_never_replans_a_manual_plan():
    costs = equal_layers(4)
    plan = partition("manual", costs, 2, 2, manual_forward=[[0, 2], [2, 4]])
    replanner = Replanner(plan, costs, 2, 2)
    assert replanner.maybe_replan(profile([layer(1.0) for _ in range(4)])) is None


def test_replanner_keeps_its_plan_without_a_clear_predicted_gain(caplog):
    """Measured costs moved past the threshold, but the best new plan is not clearly faster."""
    costs = equal_layers(16)
    plan = partition("auto", costs, 2, 8, link_bytes_per_second=LINK)
    heavy = profile([layer(0.03 if i >= 12 else 0.01) for i in range(16)])
    demanding = Replanner(plan, costs, 2, 8, threshold=0.2, min_gain=0.9, link_bytes_per_second=LINK)
    with caplog.at_level(logging.INFO, logger="lightning_roundpipe"):
        assert demanding.maybe_replan(heavy) is None
    assert demanding.plan is plan
    assert "kept its plan" in caplog.records[-1].getMessage()
