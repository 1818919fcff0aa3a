"""Keeps the plan of a running pipeline: the first plan from estimates, re-plans from measurements.

Before any step the costs are estimated from sizes and FLOPs (``cost_estimate``), so the first
step already runs a reasonable plan. Each training step's measured stage times feed per-layer
moving averages; with the ``auto`` policy the plan is rebuilt when they move by more than the
threshold (``partition.Replanner`` logs when and why). Other policies never re-plan.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..cost.estimate import MovingCostProfile, estimate_costs
from .partition import partition
from .replan import Replanner
from ..schedule.plan import Plan, PlanFacts, simple_plan
from .report import PlanReport, build_report
from ..setup_progress import ProgressCallback

log = logging.getLogger("lightning_roundpipe")

ASSUMED_TOKENS_PER_MICROBATCH = 512  # for the estimate before the first batch is seen
CHECK_STEPS = (1, 2, 3, 5, 8)  # re-plan checks early, then every CHECK_EVERY steps
CHECK_EVERY = 25


class PlanKeeper:
    """The running plan; ``progress`` hears how far the first estimate and plan search are."""

    def __init__(self, layers: list[nn.Module], num_workers: int, microbatches: int, partition_cfg, *,
                 recompute: bool, fused_last: bool, compute_dtype: torch.dtype | None,
                 link_bytes_per_second: float | None, flops_per_second: float, memory_budget_bytes: int | None,
                 progress: ProgressCallback | None = None):
        self.num_workers = num_workers
        self.microbatches = microbatches
        self.cfg = partition_cfg
        self.recompute = recompute
        dtype = compute_dtype or next((p.dtype for l in layers for p in l.parameters()), torch.float32)
        costs = estimate_costs(layers, ASSUMED_TOKENS_PER_MICROBATCH, None, dtype, flops_per_second=flops_per_second,
                               link_bytes_per_second=link_bytes_per_second, progress=progress)
        self.moving = MovingCostProfile(costs)
        n = len(layers)
        p = partition_cfg
        if p.policy in ("uniform", "params"):
            plan = simple_plan(n, num_workers, p.policy, layer_weights=[c.weight_bytes for c in costs.layers],
                               forward_stages=p.forward_stages, backward_stages=p.backward_stages,
                               same_cuts=not recompute, fused_last=fused_last)
            plan = plan.with_facts(PlanFacts(policy=p.policy, recompute=recompute))
        else:
            plan = partition(p.policy, costs, num_workers, microbatches, memory_budget_bytes=memory_budget_bytes,
                             link_bytes_per_second=link_bytes_per_second, fused_last=fused_last, recompute=recompute,
                             manual_forward=p.manual_forward, manual_backward=p.manual_backward, progress=progress)
        self.plan = plan
        self.replanner = Replanner(plan, costs, num_workers, microbatches, threshold=p.replan_threshold,
                                   policy=p.policy) if p.policy == "auto" else None
        self.steps_seen = 0

    def report(self) -> PlanReport:
        return build_report(self.plan, self.moving.profile(), self.num_workers, self.microbatches,
                            recompute=self.recompute)

    def observe(self, measurements) -> None:
        for stage, kind, seconds in measurements:
            self.moving.observe_stage((stage.start, stage.end), kind, seconds)

    def after_step(self, measurements) -> Plan | None:
        """Record one training step; return a new plan when the auto policy decided to re-plan."""
        self.observe(measurements)
        self.steps_seen += 1
        if self.replanner is None:
            return None
        if self.steps_seen not in CHECK_STEPS and self.steps_seen % CHECK_EVERY:
            return None
        new = self.replanner.maybe_replan(self.moving.profile())
        if new is not None:
            self.plan = new
        return new
