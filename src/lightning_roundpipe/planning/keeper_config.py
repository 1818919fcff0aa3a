"""``KeeperConfig``: what the plan keeper plans with, resolved once from the user's options.

``RuntimeOptions.keeper_config`` builds it with what the backend assumes where the options leave
it open; ``PlanKeeper`` takes it whole instead of a parameter per field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union


@dataclass(frozen=True)
class KeeperConfig:
    """What the plan keeper plans with (``PlanKeeper``).

    partition: how layers are cut into stages (the user's ``PartitionConfig``: ``policy``, stage counts,
        manual ranges, ``replan_threshold``).
    microbatches: microbatches per batch (None: chosen from the estimate, then for the first batch).
    recompute: "auto" (chosen from the estimate), "always", "layer", "never", or a bool (True: recompute).
    compute_dtype: the dtype weights are uploaded in (None: as stored), which the cost estimate prices.
    link_bytes_per_second: the host link the plan is timed with (None: transfers are free).
    flops_per_second: the compute rate the estimate assumes before any stage is measured.
    memory_budget_bytes: the per-worker budget the stages are planned in (None: none).
    budget_option: the option ``memory_budget_bytes`` came from, named when a plan does not fit it.
    backend: the device the planner prices ("cpu" or "cuda"): where ``recompute="auto"`` may keep graphs.
    microbatch_overhead_s: the timing model's cost per microbatch of a stage besides its compute.
    """

    partition: Any
    microbatches: Optional[int] = None
    recompute: Union[bool, str] = "auto"
    compute_dtype: Any = None
    link_bytes_per_second: Optional[float] = None
    flops_per_second: float = 1e11
    memory_budget_bytes: Optional[int] = None
    budget_option: str = "partition.memory_budget_bytes"
    backend: str = "cpu"
    microbatch_overhead_s: float = 0.0
