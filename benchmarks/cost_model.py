"""The simple cost model behind the "ideal" column: what each schedule could reach, from per-layer costs.

Inputs are measured per-layer, per-microbatch, one-thread seconds (``models.measure_layer_costs``):
``f_l`` (forward) and ``b_l`` (backward proper). With recompute on, a block's backward also
re-runs its forward; the head never recomputes (torch: it is not checkpointed; RoundPipe: its
fused last stage runs forward, loss and backward at once). So one microbatch of layer ``l``
costs ``c_l = f_l + b_l (+ f_l when recomputed)``, and the whole step ``m * W`` with
``W = sum(c_l)``.

- **Bound schedules** (GPipe, 1F1B; ``p`` ranks, ``m`` microbatches): each rank owns a contiguous
  run of layers for good (weight binding). With rank costs ``C_r`` (sum of its ``c_l``) the
  step takes ``sum(C_r) + (m - 1) * max(C_r)``: the slowest rank sets the pace for ``m - 1``
  microbatches and the pipeline fills and drains once. The split is the best contiguous one
  (smallest ``max(C_r)``, ``plan.balanced_ranges``), as one would pick by hand.
- **RoundPipe, balance bound**: ``m * W / p``: every worker busy all the time.
- **RoundPipe, plan model**: the project's list-scheduling model (``partition.predict``) of the
  plan actually run, with free dispatch and free copies: round-robin stages, per-microbatch
  dependencies, and the engine's rule that backward starts after the whole forward returned.
  Its gap to the balance bound is the schedule's own bubble; the gap between a measured run
  and it is engine overhead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_roundpipe.cost import CostProfile, LayerCost
from lightning_roundpipe.partition import partition, predict
from lightning_roundpipe.plan import Plan, balanced_ranges

from .models import LayerTiming, ShapeConfig


def layer_step_costs(timings: Sequence[LayerTiming], recompute: bool) -> list[float]:
    """Per-microbatch forward+backward cost of each layer; the last layer (head) is never recomputed."""
    last = len(timings) - 1
    return [t.forward_s + t.backward_s + (t.forward_s if recompute and i < last else 0.0) for i, t in enumerate(timings)]


def bound_split(timings: Sequence[LayerTiming], ranks: int, recompute: bool) -> list[tuple[int, int]]:
    """Best contiguous split of the layers over ``ranks`` ranks (smallest slowest rank)."""
    return [tuple(r) for r in balanced_ranges(layer_step_costs(timings, recompute), ranks)]


def rank_costs(timings: Sequence[LayerTiming], ranges: Sequence[tuple[int, int]], recompute: bool) -> list[float]:
    """Per-microbatch cost of each rank's layers."""
    c = layer_step_costs(timings, recompute)
    return [sum(c[a:b]) for a, b in ranges]


def bound_step_s(timings: Sequence[LayerTiming], ranges: Sequence[tuple[int, int]], microbatches: int, recompute: bool) -> float:
    """Modelled step of GPipe / 1F1B: ``sum(C_r) + (m - 1) * max(C_r)``."""
    rc = rank_costs(timings, ranges, recompute)
    return sum(rc) + (microbatches - 1) * max(rc)


def balance_bound_s(timings: Sequence[LayerTiming], microbatches: int, workers: int, recompute: bool) -> float:
    """``m * W / p``: no schedule on ``p`` equal workers can beat it."""
    return microbatches * sum(layer_step_costs(timings, recompute)) / workers


def cost_profile(timings: Sequence[LayerTiming], shape: ShapeConfig, weight_bytes: Sequence[int]) -> CostProfile:
    """The measured timings as the project's :class:`CostProfile` (for its partitioner and timing model)."""
    act = shape.hidden * 4 + 8  # fp32 hidden state plus the int64 target id travelling with it
    layers = [LayerCost(t.forward_s, t.forward_s, t.backward_s, int(w), int(w), act) for t, w in zip(timings, weight_bytes)]
    mb_tokens = max(1, shape.batch // shape.microbatches) * shape.seq_len
    return CostProfile(layers, tokens_per_microbatch=mb_tokens, measured=True, notes={"source": "benchmarks.models"})


@dataclass
class RoundPipePlanModel:
    """The plan RoundPipe runs and what the timing model predicts for it."""

    plan: Plan
    step_s: float  # plan model, free dispatch and copies
    bubble: float

    @property
    def forward(self) -> list[list[int]]:
        return [list(r) for r in self.plan.forward]

    @property
    def backward(self) -> list[list[int]]:
        return [list(r) for r in self.plan.backward]


def roundpipe_plan(timings: Sequence[LayerTiming], shape: ShapeConfig, weight_bytes: Sequence[int], workers: int,
                   recompute: bool) -> RoundPipePlanModel:
    """The ``auto`` partition of the measured costs (fused head), and its predicted step."""
    profile = cost_profile(timings, shape, weight_bytes)
    plan = partition("auto", profile, workers, shape.microbatches, fused_last=True, recompute=recompute,
                     stage_overhead_s=0.0)
    pred = predict(plan, profile, workers, shape.microbatches, stage_overhead_s=0.0, recompute=recompute)
    return RoundPipePlanModel(plan=plan, step_s=pred.step_s, bubble=pred.bubble)


def bound_bubble(timings: Sequence[LayerTiming], ranges: Sequence[tuple[int, int]], microbatches: int, recompute: bool) -> float:
    """Idle share of the ranks in the bound-schedule model."""
    rc = rank_costs(timings, ranges, recompute)
    step = bound_step_s(timings, ranges, microbatches, recompute)
    return 1.0 - microbatches * sum(rc) / (len(rc) * step)
