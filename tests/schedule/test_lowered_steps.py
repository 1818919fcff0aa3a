"""The step graphs of the engine and the simulator, lowered once per start worker and re-numbered (schedule/history.py),
equal what the lowering returns for every later step, and the simulations that use them are unchanged."""

import pytest

from lightning_roundpipe.cost.view import CostView
from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.options import EngineOptions
from lightning_roundpipe.schedule.lowering import LoweringOptions, lower
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.schedule.history import LoweredSteps
from lightning_roundpipe.cost.graph_timing import CostSizes


def _costs(n):
    return CostProfile(layers=[LayerCost(forward_s=0.01, recompute_s=0.01, backward_s=0.02, weight_bytes=10**8 * (i + 1),
                                         grad_bytes=10**8, act_bytes_per_token=100) for i in range(n)],
                       tokens_per_microbatch=512)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plan,workers,layer_recompute", [
    (Plan(3, ((0, 1), (1, 2), (2, 3)), ((0, 1), (1, 2), (2, 3))), 8, False),
    (Plan(4, ((0, 2), (2, 4)), ((0, 1), (1, 2), (2, 3), (3, 4))), 3, False),
    (Plan(6, ((0, 3), (3, 6)), ((0, 2), (2, 4), (3, 6)), fused_last=True), 4, True),
])
def test_renumbered_graphs_equal_the_lowering_of_each_step(plan, workers, layer_recompute):
    sizes = CostSizes(CostView(_costs(plan.num_layers)))
    options = LoweringOptions(EngineOptions(microbatches=3, recompute=True, layer_recompute=layer_recompute),
                              training=True, fused=plan.fused_last)
    steps = LoweredSteps(plan, workers, sizes, options)
    first, serial = 0, 0
    for _ in range(7):
        got = steps.graph(first, serial)
        want = lower(plan, workers, first, sizes, LoweringOptions(**{**options.__dict__, "first_serial": serial}))
        assert got == want
        assert [(t.worker, t.priority) for t in got.tasks] == [(t.worker, t.priority) for t in want.tasks]
        assert got.stage_workers == want.stage_workers and got.next_worker == want.next_worker
        first, serial = want.next_worker, want.next_serial
    for start in range(workers):  # every start worker, out of order
        want = lower(plan, workers, start, sizes, LoweringOptions(**{**options.__dict__, "first_serial": 5}))
        assert steps.graph(start, 5) == want and steps.graph(start, 5).stage_workers == want.stage_workers
    assert steps.lowerings == 1  # round robin: lowered once, every other step turned and re-numbered


@pytest.mark.timeout(60)
def test_a_schedule_that_is_not_round_robin_is_lowered_per_start_worker():
    plan = Plan(4, ((0, 2), (2, 4)), ((0, 1), (1, 2), (2, 3), (3, 4)))
    sizes = CostSizes(CostView(_costs(4)))
    options = LoweringOptions(EngineOptions(microbatches=2, schedule="sticky"))
    steps = LoweredSteps(plan, 3, sizes, options)
    for start, serial in ((0, 0), (2, 6), (0, 12)):
        assert steps.graph(start, serial) == lower(plan, 3, start, sizes,
                                                   LoweringOptions(**{**options.__dict__, "first_serial": serial}))
    assert steps.lowerings == 2
