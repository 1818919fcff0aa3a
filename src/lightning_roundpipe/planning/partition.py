"""Partition policies: turn per-layer costs into a validated ``Plan``.

* ``uniform``: equal layer counts (``simple_plan``);
* ``params``: equal weight bytes (the same);
* ``manual``: the user's layer ranges, validated;
* ``auto``: the RoundPipe partitioner (``search``), under a per-worker memory budget
  (``budget``), priced by the timing model (``predictor``);
* ``compute`` (the default): the same search; the keeper runs it once on the cost estimate
  (compute from FLOPs: an embedding is a gather, an LM head a matmul) and never re-plans, so the
  plan is a function of the model's shapes and the options.

Every policy returns its predictions with the plan (``PlanFacts``).
"""

from __future__ import annotations

from typing import Sequence

from ..cost.profile import CostProfile, StageCostModel
from ..schedule.plan import LayerRange, Plan, PlanError, PlanFacts
from .cuts import simple_plan
from .budget import check_layers_fit, check_plan_fits, stage_cap
from .predictor import DEFAULT_STAGE_OVERHEAD_S, check_inputs, link_speed, predict
from ..setup_progress import ProgressCallback
from .search import TIE_TOLERANCE, auto_plan

POLICIES = ("compute", "auto", "uniform", "params", "manual")


def manual_ranges(name: str, ranges) -> tuple[LayerRange, ...]:
    """The validated ``[start, end)`` layer ranges of the manual policy's ``name`` option."""
    if ranges is None:
        raise PlanError(f"the manual policy needs {name}=[[start, end], ...] (layer ranges, end exclusive)")
    out = []
    for item in ranges:
        try:
            start, end = item
            out.append((int(start), int(end)))
        except (TypeError, ValueError):
            raise PlanError(f"{name} entry {item!r} is not a [start, end] pair of layer indices") from None
    return tuple(out)


def partition(
    policy: str,
    costs: CostProfile,
    num_workers: int,
    microbatches: int,
    *,
    memory_budget_bytes: int | None = None,
    link_bytes_per_second: float | None = None,
    fused_last: bool = False,
    recompute: bool = True,
    manual_forward: Sequence[Sequence[int]] | None = None,
    manual_backward: Sequence[Sequence[int]] | None = None,
    stage_overhead_s: float = DEFAULT_STAGE_OVERHEAD_S,
    microbatch_overhead_s: float = 0.0,
    max_stages: int | None = None,
    progress: ProgressCallback | None = None,
    budget_option: str = "memory_budget_bytes",
) -> Plan:
    """Build and validate a plan with ``policy`` ("compute", "auto", "uniform", "params" or "manual";
    "compute" and "auto" search alike here, they differ in whether the keeper re-plans).

    Args:
        costs: per-layer costs (estimated or measured), one ``LayerCost`` per layer.
        num_workers: size of the worker pool.
        microbatches: microbatches per step.
        memory_budget_bytes: device memory one worker may use; every stage must fit in half of
            it (see the module doc). ``None`` means unlimited.
        link_bytes_per_second: host <-> worker bandwidth per direction; defaults to
            ``costs.link_bytes_per_second``; ``None`` there too means free transfers.
        fused_last: the last stage runs forward, loss and backward at once; it is both the last
            forward and the last backward stage.
        recompute: backward recomputes each stage's forward; ``False`` keeps the forward graph,
            so backward stages must equal forward stages.
        manual_forward, manual_backward: ``[[start, end], ...]`` for the manual policy
            (``manual_backward`` defaults to the forward cuts).
        stage_overhead_s: fixed cost per dispatched stage in the timing model.
        microbatch_overhead_s: fixed cost per microbatch of a dispatched stage (see ``predictor``).
        max_stages: auto only: most stages per direction of the balanced starting points
            (default ``4 * num_workers``, at least 8; more when the memory budget needs it); the
            local search may split further when that is predicted faster.
        progress: auto only: ``progress(phase, done, total)`` hears how far the plan search is
            (see ``RichSetupProgress``).
        budget_option: the option the memory budget came from, named in a refusal's advice.

    Returns:
        The validated plan; ``plan.facts`` holds the policy and the predictions.
    """
    check_inputs(costs, num_workers, microbatches)
    if policy not in POLICIES:
        raise PlanError(f"unknown partition policy {policy!r}; use one of {', '.join(repr(p) for p in POLICIES)}")
    n = len(costs)
    link = link_speed(costs, link_bytes_per_second)
    model = StageCostModel(costs, microbatches, link, recompute)
    check_layers_fit(model, memory_budget_bytes, fused_last, budget_option)

    if policy == "manual":
        forward = manual_ranges("manual_forward", manual_forward)
        backward = manual_ranges("manual_backward", manual_backward) if manual_backward is not None else forward
        plan = Plan(n, forward, backward, fused_last=fused_last).validate()
        if not recompute and not plan.same_cuts():
            raise PlanError(
                f"recompute=False keeps the forward graph, so backward stages must equal forward stages, but forward is "
                f"{[list(r) for r in plan.forward]} and backward is {[list(r) for r in plan.backward]}"
            )
    elif policy in ("uniform", "params"):
        weights = [c.weight_bytes for c in costs.layers]
        plan = simple_plan(n, num_workers, policy, layer_weights=weights, same_cuts=not recompute, fused_last=fused_last)
    else:
        plan = auto_plan(
            model,
            num_workers,
            cap=stage_cap(memory_budget_bytes),
            fused_last=fused_last,
            recompute=recompute,
            overhead_s=stage_overhead_s,
            microbatch_overhead_s=microbatch_overhead_s,
            max_stages=max_stages,
            progress=progress,
        ).validate()
    check_plan_fits(plan, model, memory_budget_bytes)

    prediction = predict(
        plan, costs, num_workers, microbatches, link_bytes_per_second=link, stage_overhead_s=stage_overhead_s, recompute=recompute,
        microbatch_overhead_s=microbatch_overhead_s,
    )
    facts = PlanFacts(
        policy=policy,
        num_workers=num_workers,
        microbatches=microbatches,
        predicted_step_s=prediction.step_s,
        predicted_bubble=prediction.bubble,
        stage_seconds=prediction.stage_seconds,
        stage_memory_bytes=prediction.stage_memory_bytes,
        link_bytes_per_second=link,
        stage_overhead_s=stage_overhead_s,
        recompute=recompute,
        memory_budget_bytes=memory_budget_bytes,
    )
    return plan.with_facts(facts).validate()


__all__ = ["DEFAULT_STAGE_OVERHEAD_S", "POLICIES", "TIE_TOLERANCE", "partition", "predict"]
