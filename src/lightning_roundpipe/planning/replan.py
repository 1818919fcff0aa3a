"""Re-planning: keep the current plan and its costs; plan again when measured costs move."""

from __future__ import annotations

import logging

from ..cost.estimate import cost_change
from ..cost.profile import CostProfile, format_seconds
from ..schedule.plan import Plan
from .partition import partition
from .predictor import predict

log = logging.getLogger("lightning_roundpipe")


class Replanner:
    """Keeps the current plan and the costs it was built from; re-plans when the costs move.

    ``options`` are passed to ``partition`` (memory budget, link, fused_last, ...); those not
    given are taken from ``plan.facts`` where ``partition`` recorded them. Only the ``auto``
    policy depends on measured times, so other policies never re-plan.
    """

    def __init__(
        self,
        plan: Plan,
        costs: CostProfile,
        num_workers: int,
        microbatches: int,
        *,
        threshold: float = 0.2,
        policy: str | None = None,
        min_gain: float = 0.05,
        **options,
    ) -> None:
        if threshold < 0:
            raise ValueError(f"threshold must be non-negative, got {threshold}")
        self.plan = plan
        self.costs = costs
        self.num_workers = num_workers
        self.microbatches = microbatches
        self.threshold = threshold
        self.min_gain = min_gain  # a new plan must be predicted at least this much faster
        self.policy = policy or plan.facts.policy or "auto"
        options.setdefault("fused_last", plan.fused_last)
        for key in ("memory_budget_bytes", "link_bytes_per_second", "stage_overhead_s", "recompute"):
            value = getattr(plan.facts, key)
            if value is not None:
                options.setdefault(key, value)  # plan again under the same assumptions
        self.options = options

    def maybe_replan(self, new_costs: CostProfile) -> Plan | None:
        """Return a new plan when some stage's cost moved by more than ``threshold`` and the
        best cuts changed; otherwise None. The costs it compares against next time are updated
        whenever it re-planned."""
        if self.policy != "auto":
            return None
        change, where = cost_change(self.costs, new_costs, self.plan)
        if change <= self.threshold:
            return None
        new_plan = partition(self.policy, new_costs, self.num_workers, self.microbatches, **self.options)
        old_plan = self.plan
        self.costs = new_costs
        same = (new_plan.forward, new_plan.backward) == (old_plan.forward, old_plan.backward)
        if not same and self.min_gain > 0:
            # Measured times are noisy: switch only for a clear predicted gain under the new costs.
            keys = ("link_bytes_per_second", "stage_overhead_s", "recompute", "microbatch_overhead_s")
            opts = {k: self.options[k] for k in keys if k in self.options}
            old_s = predict(old_plan, new_costs, self.num_workers, self.microbatches, **opts).step_s
            new_s = new_plan.facts.predicted_step_s
            if new_s > old_s * (1.0 - self.min_gain):
                log.info("RoundPipe kept its plan %s: costs moved by %.0f%% at %s, but the best new plan %s is "
                         "predicted only %.1f%% faster (needs %.0f%%)", old_plan.to_text(), 100 * change, where,
                         new_plan.to_text(), 100 * (1 - new_s / old_s) if old_s > 0 else 0.0, 100 * self.min_gain)
                return None
        self.plan = new_plan
        log.info(
            "RoundPipe re-planned because %s changed by %.0f%% (threshold %.0f%%): %s -> %s%s; predicted step %s",
            where,
            100 * change,
            100 * self.threshold,
            old_plan.to_text(),
            new_plan.to_text(),
            " (same cuts, kept)" if same else "",
            format_seconds(new_plan.facts.predicted_step_s),
        )
        return None if same else new_plan
