"""Plans for the simulator and planner: the engine's partitioner, else balanced stages.

``make_plan`` calls ``partition`` with the ``auto`` policy, so the
simulator times the plans the engine would run. Where that policy cannot meet the memory
budget, or a stage count is forced, ``balanced_plan`` cuts stages itself: forward stages balanced by forward time, backward
stages by recompute + backward time, and (for a fused last stage) the start of the fused stage
chosen to minimise the largest stage time. Equal stage times, and enough stages for every worker
to have several, are what keep a round-robin pool busy.
"""

from __future__ import annotations

from ..cost.profile import CostProfile
from ..cost.view import CostView
from ..schedule.plan import Plan, PlanError, PlanFacts
from .cuts import balanced_ranges
from .partition import partition


def _counts(num_stages: int, fwd: list[float], bwd: list[float]) -> tuple[int, int]:
    """Forward and backward stage counts summing to ``num_stages``, in proportion to their time."""
    n = len(fwd)
    total = sum(fwd) + sum(bwd)
    share = sum(fwd) / total if total > 0 else 0.5
    nf = min(n, max(1, round(num_stages * share)))
    nb = min(n, max(1, num_stages - nf))
    return nf, nb


def _largest(values: list[float], ranges) -> float:
    return max(sum(values[a:b]) for a, b in ranges)


def balanced_plan(costs: CostProfile, num_stages: int, fused_last: bool = False) -> Plan:
    """Plan with ``num_stages`` stages in all (forward + dispatched backward), of near-equal time.

    Forward and backward stage counts follow the share of time each pass takes, each split by
    ``balanced_ranges``; with ``fused_last`` the fused stage
    ``[head, n)`` takes the cut that minimises the largest stage time. Counts are capped by the
    number of layers (a stage needs a layer).
    """
    view = CostView(costs)
    n = len(view)
    fwd = [c.forward_s for c in view.layers]
    bwd = [c.recompute_s + c.backward_s for c in view.layers]
    fused_cost = [c.forward_s + c.backward_s for c in view.layers]
    facts = PlanFacts(policy="sim-balanced")
    if not fused_last:
        nf, nb = _counts(max(2, num_stages), fwd, bwd)
        return Plan(n, balanced_ranges(fwd, nf), balanced_ranges(bwd, nb), facts=facts).validate()
    if n == 1:  # the fused stage is the whole model
        return Plan(1, ((0, 1),), ((0, 1),), fused_last=True, facts=facts).validate()
    best = None
    for head in range(n - 1, 0, -1):  # the fused stage is [head, n)
        fused = sum(fused_cost[head:])
        if best is not None and fused >= best[0]:
            break  # moving the cut down only makes the fused stage heavier
        nf, nb = _counts(max(2, num_stages - 1), fwd[:head], bwd[:head])
        f_ranges, b_ranges = balanced_ranges(fwd[:head], nf), balanced_ranges(bwd[:head], nb)
        worst = max(fused, _largest(fwd, f_ranges), _largest(bwd, b_ranges))
        if best is None or worst < best[0]:
            best = (worst, head, f_ranges, b_ranges)
    worst, head, f_ranges, b_ranges = best
    return Plan(n, tuple(f_ranges) + ((head, n),), tuple(b_ranges) + ((head, n),), fused_last=True,
                facts=PlanFacts(policy="sim-balanced", max_stage_s=worst)).validate()


def make_plan(
    costs: CostProfile,
    num_workers: int,
    microbatches: int,
    *,
    memory_budget_bytes: float | None = None,
    link_bytes_per_second: float | None = None,
    fused_last: bool = False,
    num_stages: int | None = None,
) -> Plan:
    """The plan the engine would run (``partition("auto", ...)``), or ``balanced_plan`` without it.

    ``num_stages`` forces the fallback with that many stages (the planner's search); by default
    the fallback uses three stages per worker.
    """
    if num_stages is None:
        try:
            return partition("auto", costs, num_workers, microbatches, memory_budget_bytes=memory_budget_bytes,
                             link_bytes_per_second=link_bytes_per_second, fused_last=fused_last).validate()
        except (PlanError, ValueError, TypeError):
            pass  # e.g. the budget cannot be met by its policy: fall back to our own cut
    return balanced_plan(costs, num_stages or 3 * num_workers, fused_last=fused_last)
