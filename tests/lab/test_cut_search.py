"""``analysis/cut_search.py``: the cuts of a plan, the moves one layer away, and the simulated local search."""

from dataclasses import replace

import pytest

from roundpipe_lab.analysis.cut_search import cuts_of, moves, plan_of, search_cuts
from roundpipe_lab.analysis.own_engine import Setup, simulate_setup
from roundpipe_lab.analysis.workload import PublishedRun, Workload
from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.transformer import ModelShape
from lightning_roundpipe.schedule.plan import Plan, PlanError


def test_cuts_round_trip_through_a_fused_last_plan():
    plan = Plan(6, ((0, 2), (2, 5), (5, 6)), ((0, 1), (1, 5), (5, 6)), fused_last=True).validate()
    assert cuts_of(plan) == ((2, 5), (1,))
    assert plan_of(6, cuts_of(plan)) == plan
    with pytest.raises(PlanError, match="backward cut at or above the fused stage"):
        plan_of(6, ((2, 5), (1, 5)))


def test_moves_shift_merge_and_split_each_direction_and_keep_the_fused_stage():
    found = moves(((2, 5), (1,)), 6)
    assert ((3, 5), (1,)) in found and ((2, 4), (1,)) in found  # forward cuts shifted
    assert ((5,), (1,)) in found and ((2, 5), ()) in found  # a forward and a backward stage merged
    assert ((2, 3, 5), (1,)) in found and ((2, 5), (1, 3)) in found  # split
    assert ((2,), (1,)) not in found  # the fused stage's start is never removed
    assert all(0 < c < 6 for f, b in found for c in f + b)


@pytest.mark.timeout(300)
def test_the_search_leaves_a_lopsided_plan_for_a_faster_one_and_reports_what_it_simulated():
    """8 decoder layers of width 1,024 (10 layers with the embedding and the head), 8 microbatches of 1,024-token
    sequences in one call on 8 RTX 4090s; the start gives one backward stage 8 layers. The search must find a plan
    that simulates faster, and the result it reports must be that plan's simulation."""
    tiny = ModelShape("tiny", 1024, 3072, 8, 8, 128, 4096, 8)
    work = Workload(64, 8, 1, seq_len=1024)
    run = PublishedRun(tiny, work, replace(work, optimizer="sync"), 1.0, 1.0)
    hw = load_hardware("rtx4090")
    setup = Setup(microbatches=8, calls=1, compiled_layers=True, early_stop=True, staleness=0)
    lopsided = Plan(10, ((0, 1), (1, 2), (2, 9), (9, 10)), ((0, 1), (1, 9), (9, 10)), fused_last=True).validate()
    found = search_cuts(run, hw, setup, budget_s=120, start_plan=lopsided)
    assert found.start.plan == lopsided
    assert found.best.tokens_per_s > 1.2 * found.start.tokens_per_s  # measured: 176,617 -> 294,227 tokens/s
    assert found.best.plan != lopsided and found.best.plan.fused_last
    assert found.evaluated >= 2
    again = simulate_setup(run, hw, replace(setup, partition="manual"), optimizer_steps=2, plan=found.best.plan)
    assert again.tokens_per_s == pytest.approx(found.best.tokens_per_s, rel=1e-12)
    assert search_cuts(run, hw, setup, budget_s=120, start_plan=found.best.plan).best.tokens_per_s == pytest.approx(
        found.best.tokens_per_s, rel=1e-12)  # a local optimum stays put


def test_the_search_needs_a_fused_last_start():
    tiny = ModelShape("tiny", 256, 768, 4, 2, 64, 4096, 4)
    work = Workload(32, 4, 1, seq_len=256)
    run = PublishedRun(tiny, work, replace(work, optimizer="sync"), 1.0, 1.0)
    plain = Plan(6, ((0, 3), (3, 6)), ((0, 3), (3, 6))).validate()
    with pytest.raises(ValueError, match="starts from a plan with a fused last stage"):
        search_cuts(run, "rtx4090", Setup(microbatches=4), budget_s=10, start_plan=plain)
