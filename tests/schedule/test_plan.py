"""The plan as data: validation errors, text form, dispatch order, simple policies."""

import pytest

from lightning_roundpipe.planning.cuts import balanced_ranges, simple_plan, uniform_ranges
from lightning_roundpipe.schedule.plan import Plan, PlanError, dispatch


def test_text_round_trip():
    plan = Plan(6, [(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)])
    assert plan.to_text() == "F 0:3 3:6 | B 0:2 2:4 4:6"
    assert Plan.from_text(plan.to_text()) == plan
    fused = Plan(6, [(0, 4), (4, 6)], [(0, 2), (2, 4), (4, 6)], fused_last=True)
    assert Plan.from_text(fused.to_text()) == fused
    assert fused.to_text().endswith("| fused")


@pytest.mark.parametrize(
    "fwd,bwd,message",
    [
        ([(0, 3), (4, 6)], [(0, 6)], "forward stage 1 [4:6] leaves a gap: it must start at layer 3 (layers 3..3 are in no stage)"),
        ([(0, 3), (2, 6)], [(0, 6)], "forward stage 1 [2:6] overlaps the previous stage"),
        ([(0, 3), (3, 3), (3, 6)], [(0, 6)], "forward stage 1 [3:3] is empty"),
        ([(0, 3), (3, 5)], [(0, 6)], "forward stages end at layer 5 but the model has 6 layers"),
        ([(0, 6)], [(1, 6)], "backward stage 0 [1:6] leaves a gap"),
        ([(0, 6)], [], "the plan has no backward stages"),
    ],
)
def test_validation_names_the_problem(fwd, bwd, message):
    with pytest.raises(PlanError) as err:
        Plan(6, fwd, bwd).validate()
    assert message in str(err.value)


def test_fused_last_needs_equal_last_stages():
    with pytest.raises(PlanError, match="fused last stage"):
        Plan(6, [(0, 3), (3, 6)], [(0, 4), (4, 6)], fused_last=True).validate()


def test_dispatch_is_round_robin_forward_then_backward_reversed():
    plan = Plan(6, [(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)])
    tasks = dispatch(plan, 2)
    assert [(str(t.stage), t.worker) for t in tasks] == [
        ("F0[0:3]", 0), ("F1[3:6]", 1), ("B2[4:6]", 0), ("B1[2:4]", 1), ("B0[0:2]", 0)]
    assert [t.worker for t in dispatch(plan, 2, first_worker=1)] == [1, 0, 1, 0, 1]
    fused = Plan(6, [(0, 4), (4, 6)], [(0, 2), (2, 4), (4, 6)], fused_last=True)
    assert [str(t.stage) for t in dispatch(fused, 3)] == ["F0[0:4]", "F1[4:6]", "B1[2:4]", "B0[0:2]"]


def test_policies():
    assert uniform_ranges(7, 3) == ((0, 3), (3, 5), (5, 7))
    assert balanced_ranges([1, 1, 1, 1, 4], 2) == ((0, 4), (4, 5))
    assert balanced_ranges([5, 1, 1, 1, 1, 1], 3) == ((0, 1), (1, 3), (3, 6))  # then as even as possible
    plan = simple_plan(6, 2, policy="params", layer_weights=[1, 1, 1, 1, 1, 5])
    assert plan.forward == ((0, 5), (5, 6))
    assert len(plan.backward) == 4
    same = simple_plan(6, 2, policy="uniform", same_cuts=True)
    assert same.forward == same.backward == ((0, 3), (3, 6))
    fused = simple_plan(6, 2, policy="uniform", fused_last=True)
    assert fused.backward[-1] == fused.forward[-1] and fused.fused_last


def test_describe_lists_every_task():
    plan = simple_plan(4, 2, policy="uniform")
    text = plan.describe(2)
    assert "F 0:2 2:4 | B 0:1 1:2 2:3 3:4" in text
    assert text.count("-> worker") == 6
