"""The per-worker memory budget of a plan's stages (documented and conservative).

A worker holds the stage it runs and the stage it prefetches, plus one microbatch's
activations, so every stage's weights + weight gradients + one microbatch's activations (see
``memory_bytes``) must fit in half of
``memory_budget_bytes``.
"""

from __future__ import annotations

from ..cost.profile import StageCostModel, format_bytes
from ..schedule.plan import Plan, PlanError
from .predictor import dispatched_stage_costs

INF = float("inf")


def stage_cap(memory_budget_bytes: int | None) -> float:
    """Bytes one stage may hold: half the budget (a worker holds a stage and its prefetch), unlimited without
    one."""
    return INF if memory_budget_bytes is None else memory_budget_bytes / 2


def budget_text(memory_budget_bytes: int) -> str:
    """The per-stage cap in words, for error messages."""
    half = memory_budget_bytes // 2
    return (
        f"at most {format_bytes(half)} ({half} bytes), half of the per-worker memory budget of "
        f"{format_bytes(memory_budget_bytes)} ({memory_budget_bytes} bytes), since a worker holds the stage it "
        f"runs and the one it prefetches"
    )


def check_layers_fit(model: StageCostModel, memory_budget_bytes: int | None, fused_last: bool,
                     budget_option: str = "memory_budget_bytes") -> None:
    """Raise PlanError naming the first layer that cannot fit in any stage (and ``budget_option``,
    the option the budget came from, as the one to raise)."""
    if memory_budget_bytes is None:
        return
    cap = stage_cap(memory_budget_bytes)
    n = len(model.costs)
    for layer in range(n):
        kinds = ["forward", "backward"] + (["fused"] if fused_last and layer == n - 1 else [])
        worst = max((model.stage(kind, layer, layer + 1) for kind in kinds), key=lambda sc: sc.memory_bytes)
        if worst.memory_bytes > cap:
            raise PlanError(
                f"layer {layer} needs {format_bytes(worst.memory_bytes)} ({worst.memory_bytes} bytes: weights "
                f"{format_bytes(worst.weight_bytes)}, weight gradients {format_bytes(worst.grad_bytes)}, one "
                f"microbatch's activations {format_bytes(worst.activation_bytes)}) but a stage may use "
                f"{budget_text(memory_budget_bytes)}. Raise {budget_option}, use fewer tokens per "
                f"microbatch (more microbatches, or shorter sequences: attention scores and masks grow with "
                f"their square), or split the layer."
            )


def check_plan_fits(plan: Plan, model: StageCostModel, memory_budget_bytes: int | None) -> None:
    """Refuse a plan with a stage over the per-stage cap, naming the stage and what to change."""
    if memory_budget_bytes is None:
        return
    cap = stage_cap(memory_budget_bytes)
    for stage, sc in dispatched_stage_costs(plan, model):
        if sc.memory_bytes > cap:
            raise PlanError(
                f"stage {stage} needs {format_bytes(sc.memory_bytes)} ({sc.memory_bytes} bytes) but a stage may use "
                f"{budget_text(memory_budget_bytes)}. Use more, smaller stages or the 'auto' policy."
            )
