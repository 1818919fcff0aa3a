"""The simple cost model behind the "ideal" column: what each schedule could reach, from per-layer costs.

Inputs are measured per-layer, per-microbatch, one-thread seconds (``models.measure_layer_costs``):
``f_l`` (forward) and ``b_l`` (backward proper), and for blocks ``k_l``, the block's forward and
backward under ``torch.utils.checkpoint``. With recompute on, the head never recomputes (torch: it
is not checkpointed; RoundPipe: its fused last stage runs forward, loss and backward at once), and
a block costs what each system runs:

- RoundPipe recomputes a stage from its input: its forward stage runs the block's forward without
  autograd, its backward stage the forward again with autograd, then the backward:
  ``c_l = f_l + b_l + f_l`` (``layer_step_costs``).
- torch's pipeline schedules checkpoint each block, and torch's non-reentrant checkpoint stops the
  recompute as soon as it has every tensor the backward saved (``set_checkpoint_early_stop``, on by
  default; https://docs.pytorch.org/docs/stable/checkpoint): the block's last matmul, whose output
  the backward does not need, is not run again. Priced as ``2 f_l + b_l`` this cost 1.06-1.08x
  what torch ran (4 blocks of the light-head shape: 115.9 ms modelled, 107.3 ms measured; 120.7 ms
  with early stop turned off), and 1F1B ran at 0.94-1.00 of its model with recompute on against
  0.97-1.07 with it off. So the bound schedules use the measured ``c_l = k_l``
  (``bound_layer_step_costs``).

Without recompute both are ``c_l = f_l + b_l``. The whole step is ``m * W`` with ``W = sum(c_l)``.

- **Bound schedules** (GPipe, 1F1B; ``p`` ranks, ``m`` microbatches): each rank owns a contiguous
  run of layers for good (weight binding). With rank costs ``C_r`` (sum of its bound ``c_l``) the
  step takes ``sum(C_r) + (m - 1) * max(C_r)``: the slowest rank sets the pace for ``m - 1``
  microbatches and the pipeline fills and drains once. The split is the best contiguous one
  (smallest ``max(C_r)``, ``planning.cuts.balanced_ranges``), as one would pick by hand.
- **RoundPipe, balance bound**: ``m * W / p``: every worker busy all the time.
- **The optimizer** (``optimizer_s``: one step of the run's optimizer over each layer's
  parameters, measured, ``cpu_peers.measure_optimizer_costs``) is on every system's critical
  path after its backward: a bound schedule's ranks step their own layers at once (the slowest
  rank's share, ``bound_optimizer_s``); RoundPipe's host steps every layer after backward when
  it steps whole (its default on 2 CPU workers and 2 cores, ``RuntimeOptions.overlaps_optimizer``),
  and nothing when the optimizer is overlapped behind backward (``roundpipe_optimizer_s``); the
  balance bound spreads the whole step over the workers.
- **RoundPipe, plan model**: the project's list-scheduling model (``planning.predictor.predict``) of the
  plan actually run, with free dispatch and free copies: round-robin stages, per-microbatch
  dependencies; the fused head's backward stages start per microbatch as soon as the fused
  stage sent its gradient (the engine dispatches them right after it). Its gap to the balance
  bound is the schedule's own bubble; the gap between a measured run and it is engine overhead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.planning.partition import partition, predict
from lightning_roundpipe.planning.cuts import balanced_ranges
from lightning_roundpipe.schedule.plan import Plan

from .models import LayerTiming, ShapeConfig


def layer_step_costs(timings: Sequence[LayerTiming], recompute: bool) -> list[float]:
    """Per-microbatch forward+backward cost of each layer as RoundPipe runs it: a recomputed block
    runs its forward twice; the last layer (head) is never recomputed."""
    last = len(timings) - 1
    return [t.forward_s + t.backward_s + (t.forward_s if recompute and i < last else 0.0) for i, t in enumerate(timings)]


def bound_layer_step_costs(timings: Sequence[LayerTiming], recompute: bool) -> list[float]:
    """Per-microbatch cost of each layer as torch's pipeline schedules run it: with recompute, a
    block's measured cost under ``torch.utils.checkpoint`` (its recompute stops early, see the module
    doc); a timing without that measurement is priced as RoundPipe's (``layer_step_costs``)."""
    last = len(timings) - 1
    roundpipe = layer_step_costs(timings, recompute)
    return [t.checkpointed_s if recompute and i < last and t.checkpointed_s is not None else roundpipe[i]
            for i, t in enumerate(timings)]


def bound_split(timings: Sequence[LayerTiming], ranks: int, recompute: bool) -> list[tuple[int, int]]:
    """Best contiguous split of the layers over ``ranks`` ranks (smallest slowest rank)."""
    return [tuple(r) for r in balanced_ranges(bound_layer_step_costs(timings, recompute), ranks)]


def rank_costs(timings: Sequence[LayerTiming], ranges: Sequence[tuple[int, int]], recompute: bool) -> list[float]:
    """Per-microbatch cost of each rank's layers (as the bound schedules run them)."""
    c = bound_layer_step_costs(timings, recompute)
    return [sum(c[a:b]) for a, b in ranges]


def bound_step_s(timings: Sequence[LayerTiming], ranges: Sequence[tuple[int, int]], microbatches: int, recompute: bool) -> float:
    """Modelled step of GPipe / 1F1B: ``sum(C_r) + (m - 1) * max(C_r)``."""
    rc = rank_costs(timings, ranges, recompute)
    return sum(rc) + (microbatches - 1) * max(rc)


def bound_optimizer_s(optimizer_s: Sequence[float], ranges: Sequence[tuple[int, int]]) -> float:
    """The bound schedules' optimizer: every rank steps its own layers at once, the slowest sets the time."""
    return max(sum(optimizer_s[a:b]) for a, b in ranges) if optimizer_s else 0.0


def roundpipe_optimizer_s(optimizer_s: Sequence[float], overlapped: bool) -> float:
    """RoundPipe's optimizer on the step's critical path: the whole step on the host after backward,
    or nothing when it is overlapped layer by layer behind backward."""
    return 0.0 if overlapped else sum(optimizer_s)


def balance_bound_s(timings: Sequence[LayerTiming], microbatches: int, workers: int, recompute: bool) -> float:
    """``m * W / p``: no schedule on ``p`` equal workers can beat it."""
    return microbatches * sum(layer_step_costs(timings, recompute)) / workers


def cost_profile(timings: Sequence[LayerTiming], shape: ShapeConfig, weight_bytes: Sequence[int]) -> CostProfile:
    """The measured timings as the project's :class:`CostProfile` (for its partitioner and timing model)."""
    act = shape.hidden * 4 + 8  # fp32 hidden state plus the int64 target id travelling with it
    layers = [LayerCost(t.forward_s, t.forward_s, t.backward_s, int(w), int(w), act) for t, w in zip(timings, weight_bytes)]
    mb_tokens = max(1, shape.batch // shape.microbatches) * shape.seq_len
    return CostProfile(layers, tokens_per_microbatch=mb_tokens, measured=True, source="benchmarks.peers.models")


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
    """The ``auto`` partition of the measured costs (fused head), and its predicted step (free dispatch)."""
    profile = cost_profile(timings, shape, weight_bytes)
    # Planned as the runtime plans (its default per-stage overhead); priced with free dispatch.
    plan = partition("auto", profile, workers, shape.microbatches, fused_last=True, recompute=recompute)
    pred = predict(plan, profile, workers, shape.microbatches, stage_overhead_s=0.0, recompute=recompute)
    return RoundPipePlanModel(plan=plan, step_s=pred.step_s, bubble=pred.bubble)


def bound_bubble(timings: Sequence[LayerTiming], ranges: Sequence[tuple[int, int]], microbatches: int, recompute: bool) -> float:
    """Idle share of the ranks in the bound-schedule model."""
    rc = rank_costs(timings, ranges, recompute)
    step = bound_step_s(timings, ranges, microbatches, recompute)
    return 1.0 - microbatches * sum(rc) / (len(rc) * step)


# ------------------------------------------------------------------ exhaustive plan search
# The functions below price a plan on their own (a few lines, independent of the project's
# timing model) and search every plan of a small model, to check the project's partitioner
# against the true optimum of the same model.

def stage_costs(timings: Sequence[LayerTiming], forward: Sequence[Sequence[int]], backward: Sequence[Sequence[int]],
                recompute: bool) -> tuple[list[float], list[float]]:
    """Per-microbatch compute of the forward stages (last one fused) and of the dispatched backward stages.

    ``backward`` lists backward ranges in layer order, ending with the fused stage (as in a Plan);
    the result's backward list is in dispatch order (reverse), without the fused stage.
    """
    f = [t.forward_s for t in timings]
    b = [t.backward_s for t in timings]
    fwd = [sum(f[s:e]) for s, e in forward[:-1]]
    s, e = forward[-1]
    fwd.append(sum(f[s:e]) + sum(b[s:e]))  # fused: forward + loss + backward at once, never recomputed
    bwd = [sum(b[s:e]) + (sum(f[s:e]) if recompute else 0.0) for s, e in reversed(list(backward)[:-1])]
    return fwd, bwd


def round_robin_step_s(forward_costs: Sequence[float], backward_costs: Sequence[float], microbatches: int,
                       workers: int, barrier: bool = True) -> float:
    """Step time of round-robin dispatch with free copies and dispatch.

    Stage k goes to worker ``k % workers``; its microbatch i starts when the worker is free and
    microbatch i of the previous stage is done. ``barrier``: backward waits for the whole forward
    (how the engine runs without a fused last stage); without it, backward microbatch i starts
    once the fused stage produced it (the engine with a fused last stage, as here).
    """
    free = [0.0] * workers
    ready = [0.0] * microbatches
    forward_end = 0.0
    for k, cost in enumerate(list(forward_costs) + list(backward_costs)):
        if k == len(forward_costs) and barrier:
            ready = [forward_end] * microbatches
        w = k % workers
        t = free[w]
        done = []
        for i in range(microbatches):
            t = max(t, ready[i]) + cost
            done.append(t)
        free[w] = t
        ready = done
        if k < len(forward_costs):
            forward_end = max(forward_end, done[-1])
    return max(free)


def _compositions(start: int, end: int):
    """Every split of [start, end) into contiguous non-empty ranges."""
    n = end - start
    for mask in range(1 << max(n - 1, 0)):
        cuts = [start + i + 1 for i in range(n - 1) if mask >> i & 1]
        bounds = [start] + cuts + [end]
        yield [(bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1)]


def best_plan(timings: Sequence[LayerTiming], microbatches: int, workers: int, recompute: bool, barrier: bool = False,
              max_layers: int = 12) -> tuple[float, list, list]:
    """The fastest plan under :func:`round_robin_step_s` (exhaustive; fused last stage holding the head).

    Returns (step seconds, forward ranges, backward ranges in layer order ending with the fused stage).
    With ``recompute=False`` backward stages equal forward stages, as the engine requires.
    """
    n = len(timings)
    if n > max_layers:
        raise ValueError(f"exhaustive plan search is for at most {max_layers} layers, got {n}")
    best = (float("inf"), [], [])
    for forward in _compositions(0, n):
        head = forward[-1]
        choices = [forward[:-1]] if not recompute else (list(_compositions(0, head[0])) if head[0] > 0 else [[]])
        for inner in choices:
            backward = list(inner) + [head]
            fc, bc = stage_costs(timings, forward, backward, recompute)
            t = round_robin_step_s(fc, bc, microbatches, workers, barrier)
            if t < best[0] - 1e-12:
                best = (t, [list(r) for r in forward], [list(r) for r in backward])
    return best
