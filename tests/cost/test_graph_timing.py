"""The planner's closed-form predictor is a fast path of the one timing model (cost/graph_timing.py).

On random lowered graphs with free transfers and no host costs, where the predictor claims to be
exact, its step time equals the simulator's timing of the graph task by task (the simulator adds
only host work, priced at zero here, to the library's rules): equal up to floating-point summation
order (the predictor sums prefix sums, the timing model sums layers). With a limited link the
predictor is an estimate; tests/schedule/test_lowering.py bounds its error there.
"""

from __future__ import annotations

import random
import time

import pytest

from lightning_roundpipe.cost.graph_timing import compute_seconds, link_seconds
from lightning_roundpipe.cost.hardware import HardwareProfile
from lightning_roundpipe.cost.layer_costs import CostProfile, LayerCost
from lightning_roundpipe.cost.view import CostView
from lightning_roundpipe.planning.predictor import predict
from lightning_roundpipe.schedule.dispatch_order import SCHEDULES
from lightning_roundpipe.schedule.graph_task import TaskKind
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.sim import SimConfig, simulate_roundpipe

DEFAULT_GRAPHS = 100  # about 3 s here; the slow variant times 4000
RELATIVE_ROUNDING = 1e-9  # the two sum the same seconds in another order; anything above is a rule that differs


def random_costs(rng: random.Random, n: int) -> CostProfile:
    """``n`` layers of random times (some stopping their recompute early) and sizes."""
    layers = []
    for _ in range(n):
        f = rng.uniform(0.2, 3.0) * 1e-3
        early = rng.choice([0.0, rng.uniform(0.0, 0.5) * f])
        layers.append(LayerCost(f, f * rng.uniform(0.8, 1.2), f * rng.uniform(1.5, 2.5), rng.randint(1, 8) * 10**6,
                                rng.choice([0, 10**6]), rng.randint(100, 4000), early_stop_s=early))
    return CostProfile(layers, tokens_per_microbatch=rng.choice([16, 128]))


def ranges(cuts, n: int) -> tuple[tuple[int, int], ...]:
    bounds = (0, *sorted(cuts), n)
    return tuple(zip(bounds[:-1], bounds[1:]))


def random_plan(rng: random.Random, n: int) -> Plan:
    """Forward and backward cut independently; with a fused last stage, the backward ends with it."""
    fused = rng.random() < 0.5
    fcuts = rng.sample(range(1, n), rng.randint(0, n - 1))
    if fused and fcuts:
        h = max(fcuts)
        bcuts = rng.sample(range(1, h), rng.randint(0, h - 1)) + [h] if h > 1 else [h]
    elif fused:
        bcuts = []
    else:
        bcuts = rng.sample(range(1, n), rng.randint(0, n - 1))
    plan = Plan(n, ranges(fcuts, n), ranges(bcuts, n), fused_last=fused)
    plan.validate()
    return plan


def free_link_machine(workers: int) -> HardwareProfile:
    return HardwareProfile(name="free link", num_gpus=workers, tflops=1.0, gpu_memory_bytes=10**15,
                           host_device_bytes_per_s=float("inf"), host_memory_bytes=10**15,
                           cpu_optimizer_params_per_s=float("inf"))


def compare(graphs: int, seed: int) -> list[float]:
    """Relative differences |predicted - timed| / timed of ``graphs`` random plans."""
    rng = random.Random(seed)
    out = []
    for _ in range(graphs):
        n, workers, m = rng.randint(2, 10), rng.randint(1, 6), rng.randint(1, 6)
        costs, schedule = random_costs(rng, n), rng.choice(sorted(SCHEDULES))
        plan = random_plan(rng, n)
        predicted = predict(plan, costs, workers, m, stage_overhead_s=0.0, schedule=SCHEDULES[schedule]).step_s
        timed = simulate_roundpipe(plan, costs, free_link_machine(workers), m, config=SimConfig(
            steps=1, schedule=schedule, dispatch_s=0.0, launch_s=0.0)).step_s
        out.append(abs(predicted - timed) / timed)
    return out


def test_the_predictor_equals_the_timing_model_on_random_graphs():
    start = time.perf_counter()
    worst = max(compare(DEFAULT_GRAPHS, seed=45))
    print(f"{DEFAULT_GRAPHS} graphs in {time.perf_counter() - start:.1f} s, worst relative difference {worst:.1e}")
    assert worst <= RELATIVE_ROUNDING


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_predictor_equals_the_timing_model_on_thousands_of_random_graphs():
    start = time.perf_counter()
    worst = max(compare(4000, seed=4500))
    print(f"4000 graphs in {time.perf_counter() - start:.1f} s, worst relative difference {worst:.1e}")
    assert worst <= RELATIVE_ROUNDING


def test_a_predictor_rule_that_differs_is_caught():
    # The comparison is not vacuous: a predictor that forgot the early stop of a backward stage's
    # last recompute (one rule of compute_seconds) differs by far more than the rounding bound.
    costs = CostProfile([LayerCost(1e-3, 1e-3, 2e-3, 10**6, 10**6, 100, early_stop_s=4e-4)] * 4, tokens_per_microbatch=16)
    plan = Plan(4, ((0, 2), (2, 4)), ((0, 2), (2, 4)))
    timed = simulate_roundpipe(plan, costs, free_link_machine(2), 2, config=SimConfig(steps=1, dispatch_s=0.0,
                                                                                      launch_s=0.0)).step_s
    predicted = predict(plan, costs, 2, 2, stage_overhead_s=0.0).step_s
    assert abs(predicted - timed) / timed <= RELATIVE_ROUNDING
    forgetful = CostProfile([LayerCost(1e-3, 1e-3, 2e-3, 10**6, 10**6, 100)] * 4, tokens_per_microbatch=16)
    assert abs(predict(plan, forgetful, 2, 2, stage_overhead_s=0.0).step_s - timed) / timed > 100 * RELATIVE_ROUNDING


def test_compute_and_link_prices():
    # The one set of prices every reader uses (hand-computed from the layer costs).
    costs = CostProfile([LayerCost(1.0, 1.5, 2.0, 8, 8, 1, early_stop_s=0.25),
                         LayerCost(3.0, 3.5, 4.0, 8, 8, 1, early_stop_s=0.5)], tokens_per_microbatch=1)
    view = CostView(costs)
    assert compute_seconds(view, TaskKind.FORWARD, 0, 2) == 4.0
    assert compute_seconds(view, TaskKind.FUSED, 0, 2) == 10.0
    assert compute_seconds(view, TaskKind.BACKWARD, 0, 2) == 1.5 + 2.0 + 3.5 + 4.0 - 0.5  # the last layer stops early
    # layer grain: every layer stops early, and a pass without grad keeps the layer inputs first
    assert compute_seconds(view, TaskKind.BACKWARD, 0, 2, "layer") == 10.5 - 0.25 + 1.0
    assert compute_seconds(view, TaskKind.BACKWARD, 0, 2, "layer", inputs_kept=True) == 10.5 - 0.25
    assert link_seconds(100, 50.0, 0.5) == 2.5
    assert link_seconds(100, float("inf"), 0.5) == 0.5
