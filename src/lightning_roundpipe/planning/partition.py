"""Partition policies: turn per-layer costs into a validated :class:`~.plan.Plan`.

Policies:

* ``uniform``: equal layer counts (``plan.simple_plan``);
* ``params``: equal weight bytes (``plan.simple_plan``);
* ``manual``: the user's layer ranges, validated;
* ``auto``: the RoundPipe partitioner, a search against the timing model below under a
  per-worker memory budget. It starts from balanced cuts (for every stage count, forward and
  backward cut independently so that the stages of each direction cost about the same: a heavy
  stage holds its worker while the rest of the round-robin queue waits behind it), simulates
  every pairing, then improves the fastest few by local moves (shift one cut by a layer, merge
  two neighbouring stages, split one) as long as the predicted step gets shorter; models with
  few layers are searched exhaustively. Plans within 2% of the fastest count as tied and the
  one with the fewest stages wins (``TIE_TOLERANCE``). Balanced cuts alone are not enough:
  with a fused last stage the backward stages run alongside it, so the best cuts are the ones
  that keep every worker busy, not the ones that equalise each direction.

Every policy stores its predictions in ``plan.notes``: ``policy``, ``stage_seconds`` (per
dispatched stage, e.g. ``{"F0": ..., "B3": ...}``), ``stage_memory_bytes``,
``predicted_step_s`` and ``predicted_bubble``.

The timing model (:func:`predict`) is a small list-scheduling simulation of one training step:

* tasks are the forward stages in order, then the backward stages in reverse, dispatched
  round-robin; a worker runs its tasks one after another, paying ``stage_overhead_s`` per task
  (dispatch, events, launch gaps);
* microbatch i of a stage starts when the worker is free, the stage's weights are on the
  worker, and its input is: the previous stage's microbatch i output, downloaded to the host
  and uploaded again (workers are stateless, data goes through the host);
* weights of a worker's next stage are prefetched from the moment its current stage starts,
  after the current stage's input uploads (which have priority); gradients are downloaded
  last and only delay the end of the step;
* without a fused last stage, backward starts when the whole forward is done
  (``loss.backward()`` runs after the forward returned); with one, backward microbatch i
  starts as soon as the fused stage sent back its input gradient (the engine dispatches the
  backward stages right after the fused stage, no barrier).

Memory rule (documented and conservative): a worker holds the stage it runs and the stage it
prefetches, plus one microbatch's activations, so every stage's weights + weight gradients +
one microbatch's activations (see :class:`~.cost.StageCostModel`) must fit in half of
``memory_budget_bytes``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from ..cost.profile import CostProfile, StageCost, StageCostModel, format_bytes, format_seconds
from ..cost.estimate import cost_change
from ..schedule.plan import LayerRange, Plan, PlanError, Stage, simple_plan

log = logging.getLogger("lightning_roundpipe")

POLICIES = ("auto", "uniform", "params", "manual")
DEFAULT_STAGE_OVERHEAD_S = 1e-3  # per dispatched stage: event waits, kernel-launch gaps, Python dispatch
INF = float("inf")


# --------------------------------------------------------------------- timing model
@dataclass(frozen=True)
class Prediction:
    """What the timing model predicts for one step of a plan."""

    step_s: float
    bubble: float  # share of worker time spent not computing
    stage_seconds: dict[str, float]  # per dispatched stage: max(compute, upload, download)
    stage_memory_bytes: dict[str, int]
    forward_s: float  # when the whole forward is back on the host


def dispatched_stage_costs(plan: Plan, model: StageCostModel) -> list[tuple[Stage, StageCost]]:
    """(stage, cost) of every dispatched stage in dispatch order; the fused stage is the last forward one."""
    out = []
    last = len(plan.forward) - 1
    for stage in plan.forward_stages():
        kind = "fused" if plan.fused_last and stage.index == last else "forward"
        out.append((stage, model.stage(kind, stage.start, stage.end)))
    for stage in plan.dispatched_backward_stages():
        out.append((stage, model.stage("backward", stage.start, stage.end)))
    return out


def _simulate(stages: Sequence[StageCost], num_forward: int, num_workers: int, overhead_s: float,
              barrier: bool = True) -> tuple[float, float, float]:
    """Round-robin list scheduling of one step; returns (step seconds, busy compute seconds, forward end).

    ``barrier``: backward waits for the whole forward (runs without a fused last stage); a fused
    run passes False and each backward microbatch waits only for its own output gradient.
    """
    if not stages:
        return 0.0, 0.0, 0.0
    m = stages[0].microbatches
    compute_free = [0.0] * num_workers
    download_free = [0.0] * num_workers
    previous_start: list[float | None] = [None] * num_workers
    previous_input_upload = [0.0] * num_workers
    inputs = [0.0] * m  # when microbatch i's input is on the host
    step_end = busy = forward_end = 0.0
    for k, sc in enumerate(stages):
        if k == num_forward and barrier:
            inputs = [forward_end] * m  # backward waits for the whole forward
        w = k % num_workers
        prefetch_from = 0.0 if previous_start[w] is None else previous_start[w] + previous_input_upload[w]
        upload_free = prefetch_from + sc.weight_upload_s
        free = compute_free[w] + overhead_s
        first_start = None
        outputs = []
        for i in range(m):
            upload_free = max(upload_free, inputs[i]) + sc.microbatch_upload_s
            start = max(free, upload_free)
            if first_start is None:
                first_start = start
            free = start + sc.microbatch_compute_s
            download_free[w] = max(download_free[w], free) + sc.microbatch_download_s
            outputs.append(download_free[w])
        download_free[w] += sc.grad_download_s
        compute_free[w] = free
        previous_start[w] = first_start
        previous_input_upload[w] = m * sc.microbatch_upload_s
        busy += sc.compute_s
        step_end = max(step_end, download_free[w])
        if k < num_forward:
            forward_end = max(forward_end, outputs[-1])
        inputs = outputs
    return step_end, busy, forward_end


def predict(
    plan: Plan,
    costs: CostProfile,
    num_workers: int,
    microbatches: int,
    *,
    link_bytes_per_second: float | None = None,
    stage_overhead_s: float = DEFAULT_STAGE_OVERHEAD_S,
    recompute: bool = True,
) -> Prediction:
    """Predict step time, bubble fraction and per-stage seconds/memory of ``plan`` (see module doc)."""
    _check_inputs(costs, num_workers, microbatches)
    if plan.num_layers != len(costs):
        raise PlanError(f"the plan covers {plan.num_layers} layers but the cost profile has {len(costs)}")
    model = StageCostModel(costs, microbatches, link_speed(costs, link_bytes_per_second), recompute)
    staged = dispatched_stage_costs(plan, model)
    step, busy, forward_end = _simulate([sc for _, sc in staged], len(plan.forward), num_workers, stage_overhead_s,
                                        barrier=not plan.fused_last)
    bubble = 1.0 - busy / (num_workers * step) if step > 0 else 0.0
    return Prediction(
        step_s=step,
        bubble=max(0.0, bubble),
        stage_seconds={s.name: sc.seconds for s, sc in staged},
        stage_memory_bytes={s.name: sc.memory_bytes for s, sc in staged},
        forward_s=forward_end,
    )


def link_speed(costs: CostProfile, link_bytes_per_second: float | None) -> float | None:
    """The explicit link speed, else the one the cost estimate recorded, else None (free transfers)."""
    return link_bytes_per_second if link_bytes_per_second is not None else costs.notes.get("link_bytes_per_second")


def _check_inputs(costs: CostProfile, num_workers: int, microbatches: int) -> None:
    if len(costs) < 1:
        raise PlanError("the cost profile has no layers: there is nothing to partition")
    if num_workers < 1:
        raise PlanError(f"num_workers must be at least 1, got {num_workers}")
    if microbatches < 1:
        raise PlanError(f"microbatches must be at least 1, got {microbatches}")


# --------------------------------------------------------------------- memory
def _stage_cap(memory_budget_bytes: int | None) -> float:
    return INF if memory_budget_bytes is None else memory_budget_bytes / 2


def _budget_text(memory_budget_bytes: int) -> str:
    half = memory_budget_bytes // 2
    return (
        f"at most {format_bytes(half)} ({half} bytes), half of the per-worker memory budget of "
        f"{format_bytes(memory_budget_bytes)} ({memory_budget_bytes} bytes), since a worker holds the stage it "
        f"runs and the one it prefetches"
    )


def _check_layers_fit(model: StageCostModel, memory_budget_bytes: int | None, fused_last: bool) -> None:
    """Raise PlanError naming the first layer that cannot fit in any stage."""
    if memory_budget_bytes is None:
        return
    cap = _stage_cap(memory_budget_bytes)
    n = len(model.costs)
    for layer in range(n):
        kinds = ["forward", "backward"] + (["fused"] if fused_last and layer == n - 1 else [])
        worst = max((model.stage(kind, layer, layer + 1) for kind in kinds), key=lambda sc: sc.memory_bytes)
        if worst.memory_bytes > cap:
            raise PlanError(
                f"layer {layer} needs {format_bytes(worst.memory_bytes)} ({worst.memory_bytes} bytes: weights "
                f"{format_bytes(worst.weight_bytes)}, weight gradients {format_bytes(worst.grad_bytes)}, one "
                f"microbatch's activations {format_bytes(worst.activation_bytes)}) but a stage may use "
                f"{_budget_text(memory_budget_bytes)}. Raise memory_budget_bytes, use fewer tokens per "
                f"microbatch, or split the layer."
            )


def _check_plan_fits(plan: Plan, model: StageCostModel, memory_budget_bytes: int | None) -> None:
    if memory_budget_bytes is None:
        return
    cap = _stage_cap(memory_budget_bytes)
    for stage, sc in dispatched_stage_costs(plan, model):
        if sc.memory_bytes > cap:
            raise PlanError(
                f"stage {stage} needs {format_bytes(sc.memory_bytes)} ({sc.memory_bytes} bytes) but a stage may use "
                f"{_budget_text(memory_budget_bytes)}. Use more, smaller stages or the 'auto' policy."
            )


# --------------------------------------------------------------------- min-max cuts
class _Cuts:
    """Best contiguous cuts of the layer prefix ``[0, i)`` into ``j`` stages, minimising the costliest stage.

    ``table[s][i]`` is the cost of stage ``[s, i)`` (INF when it breaks the memory budget).
    Exact dynamic programme over stage counts ``1..max_stages``; ties prefer earlier cuts.
    """

    def __init__(self, table: list[list[float]], num_layers: int, max_stages: int) -> None:
        self.table = table
        n, k_max = num_layers, max(1, min(max_stages, num_layers))
        self.best = [[INF] * (n + 1) for _ in range(k_max + 1)]
        self.arg = [[-1] * (n + 1) for _ in range(k_max + 1)]
        self.best[0][0] = 0.0
        for j in range(1, k_max + 1):
            prev, cur, arg = self.best[j - 1], self.best[j], self.arg[j]
            for i in range(j, n + 1):
                best_value, best_start = INF, -1
                for s in range(j - 1, i):
                    p = prev[s]
                    if p >= best_value:
                        continue
                    c = table[s][i]
                    v = p if p > c else c
                    if v < best_value:
                        best_value, best_start = v, s
                cur[i], arg[i] = best_value, best_start
        self.max_stages = k_max

    def ranges(self, stages: int, end: int) -> tuple[LayerRange, ...] | None:
        """The cuts of ``[0, end)`` into ``stages`` stages, or None when none fits."""
        if stages > self.max_stages or self.best[stages][end] == INF:
            return None
        out, i = [], end
        for j in range(stages, 0, -1):
            s = self.arg[j][i]
            out.append((s, i))
            i = s
        return tuple(reversed(out))


def _cost_table(model: StageCostModel, kind: str, cap: float) -> list[list[float]]:
    n = len(model.costs)
    table = [[INF] * (n + 1) for _ in range(n + 1)]
    for s in range(n):
        for e in range(s + 1, n + 1):
            sc = model.stage(kind, s, e)
            if sc.memory_bytes <= cap:
                table[s][e] = sc.seconds
    return table


# --------------------------------------------------------------------- auto policy
MAX_EVALUATIONS = 6000  # plans the local search may simulate (about 1.5 s for 40 layers on 8 workers)
EXHAUSTIVE_PLANS = 6000  # plan spaces up to this size are searched exhaustively (exact optimum; < 1 s)
# Plans predicted within this share of the fastest count as tied, and the one with the fewest
# stages wins: measured costs are noisy at this level, and every stage adds tasks, transfers and
# hand-overs between workers that the timing model does not price (on the 2-core CPU benchmark a
# plan with 4 more stages, predicted 0.2% faster, ran 5% slower).
TIE_TOLERANCE = 0.02


class _Search:
    """Plans as cut positions, priced by the timing model; memoised.

    A plan is ``(fcuts, bcuts)``: the interior layer boundaries of the forward and the backward
    stages (sorted tuples). With a fused last stage the last forward cut ``h`` is where the fused
    stage starts; the backward stages are ``bcuts`` (all below ``h``) plus ``h``. Without
    recompute the backward cuts are the forward cuts.
    """

    def __init__(self, model: StageCostModel, num_workers: int, cap: float, fused_last: bool, recompute: bool,
                 overhead_s: float) -> None:
        self.model, self.num_workers, self.cap = model, num_workers, cap
        self.fused_last, self.recompute, self.overhead_s = fused_last, recompute, overhead_s
        self.n = len(model.costs)
        self.seen: dict[tuple, float] = {}
        self._stages: dict[tuple, StageCost] = {}

    def stage(self, kind: str, a: int, b: int) -> StageCost:
        """``model.stage``, memoised (the search prices the same stages over and over)."""
        key = (kind, a, b)
        if key not in self._stages:
            self._stages[key] = self.model.stage(kind, a, b)
        return self._stages[key]

    def ranges(self, cuts: tuple[int, ...]) -> tuple[LayerRange, ...]:
        bounds = (0,) + cuts + (self.n,)
        return tuple((bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1))

    def plan(self, fcuts: tuple[int, ...], bcuts: tuple[int, ...]) -> Plan:
        forward = self.ranges(fcuts)
        if not self.recompute:
            backward = forward
        elif self.fused_last:
            backward = self.ranges(bcuts + fcuts[-1:]) if fcuts else ((0, self.n),)
        else:
            backward = self.ranges(bcuts)
        return Plan(self.n, forward, backward, fused_last=self.fused_last)

    def normalise(self, fcuts, bcuts) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Sorted, in range, consistent cuts (None when the move makes no plan)."""
        fcuts = tuple(sorted(set(fcuts)))
        if any(c <= 0 or c >= self.n for c in fcuts):
            return None
        if not self.recompute:
            return fcuts, fcuts
        h = fcuts[-1] if (self.fused_last and fcuts) else (0 if self.fused_last else self.n)
        bcuts = tuple(sorted(c for c in set(bcuts) if 0 < c < h))
        return fcuts, bcuts

    def step_s(self, fcuts: tuple[int, ...], bcuts: tuple[int, ...]) -> float:
        key = (fcuts, bcuts)
        if key in self.seen:
            return self.seen[key]
        plan = self.plan(fcuts, bcuts)
        staged = [sc for _, sc in dispatched_stage_costs(plan, self)]
        if any(sc.memory_bytes > self.cap for sc in staged):
            value = INF  # some stage breaks the memory budget
        else:
            value = _simulate(staged, len(plan.forward), self.num_workers, self.overhead_s,
                              barrier=not self.fused_last)[0]
        self.seen[key] = value
        return value

    def _moves(self, cuts: tuple[int, ...]):
        """Cut sets one move from ``cuts``: shift a cut by one layer, drop one (merge), add one (split)."""
        for i, c in enumerate(cuts):
            rest = cuts[:i] + cuts[i + 1:]
            yield rest + (c - 1,)
            yield rest + (c + 1,)
            yield rest
        for c in range(1, self.n):
            if c not in cuts:
                yield cuts + (c,)

    def neighbours(self, fcuts: tuple[int, ...], bcuts: tuple[int, ...]):
        """Plans one move away, in the forward cuts, in the backward cuts, or in both at once:
        shift or drop a cut they share, add one neither has (``None`` where no plan results)."""
        for f in self._moves(fcuts):
            yield self.normalise(f, bcuts)
        if not self.recompute:
            return  # backward cuts follow the forward ones
        for b in self._moves(bcuts):
            yield self.normalise(fcuts, b)
        fs, bs = set(fcuts), set(bcuts)
        for c in sorted(fs & bs):
            for new in ((c - 1,), (c + 1,), ()):
                yield self.normalise(tuple(fs - {c}) + new, tuple(bs - {c}) + new)
        for c in range(1, self.n):
            if c not in fs and c not in bs:
                yield self.normalise(fcuts + (c,), bcuts + (c,))

    def _subsets(self, lo: int, hi: int):
        """Every set of interior cuts strictly between ``lo`` and ``hi``."""
        inner = list(range(lo + 1, hi))
        for mask in range(1 << len(inner)):
            yield tuple(c for i, c in enumerate(inner) if mask >> i & 1)

    def space_size(self) -> int:
        """How many plans there are (forward cuts x backward cuts allowed by them)."""
        n = self.n
        if not self.recompute:
            return 2 ** (n - 1)
        if not self.fused_last:
            return 4 ** (n - 1)
        # fused stage from h: forward cuts below h (2^(h-1)) times backward cuts below h (2^(h-1))
        return 1 + sum(4 ** (h - 1) for h in range(1, n))

    def every_plan(self):
        n = self.n
        if not self.recompute:
            for f in self._subsets(0, n):
                yield f, f
        elif not self.fused_last:
            for f in self._subsets(0, n):
                for b in self._subsets(0, n):
                    yield f, b
        else:
            yield (), ()
            for h in range(1, n):
                for f in self._subsets(0, h):
                    for b in self._subsets(0, h):
                        yield f + (h,), b

    def improve(self, fcuts: tuple[int, ...], bcuts: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Steepest descent over :meth:`neighbours` until no move shortens the predicted step."""
        best, best_s = (fcuts, bcuts), self.step_s(fcuts, bcuts)
        while len(self.seen) < MAX_EVALUATIONS:
            found = None
            for nb in self.neighbours(*best):
                if nb is None:
                    continue
                s = self.step_s(*nb)
                if s < best_s * (1 - 1e-9):
                    best_s, found = s, nb
            if found is None:
                break
            best = found
        return best


def _cuts_of(ranges: Sequence[LayerRange]) -> tuple[int, ...]:
    return tuple(a for a, _ in ranges[1:])


def _min_max_cuts(model: StageCostModel, kind: str, cap: float, k_limit: int) -> _Cuts:
    """Min-max cuts of one direction for up to ``k_limit`` stages (more when the budget needs them)."""
    n = len(model.costs)
    cuts = _Cuts(_cost_table(model, kind, cap), n, k_limit)
    if all(cuts.best[k][n] == INF for k in range(1, cuts.max_stages + 1)):
        cuts = _Cuts(cuts.table, n, n)  # the budget needs more stages than the usual limit
    return cuts


def _num_stages(cuts: tuple[tuple[int, ...], tuple[int, ...]]) -> int:
    return len(cuts[0]) + len(cuts[1])


def _seed_plans(model: StageCostModel, search: _Search, k_limit: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Starting points: for every stage count, the min-max balanced cuts of each direction, paired."""
    n, cap, fused_last = search.n, search.cap, search.fused_last
    fwd_cuts = _min_max_cuts(model, "forward", cap, k_limit)
    fused_cost = [model.stage("fused", h, n) for h in range(n)] if fused_last else []
    forward_options: list[tuple[LayerRange, ...]] = []
    for k in range(1, fwd_cuts.max_stages + 1):
        if not fused_last:
            ranges = fwd_cuts.ranges(k, n)
        elif k == 1:
            ranges = ((0, n),) if fused_cost[0].memory_bytes <= cap else None
        else:  # the fused stage where it best matches the balanced forward stages below it
            best_h, best_value = None, INF
            for h in range(k - 1, n):
                if fused_cost[h].memory_bytes > cap:
                    continue
                value = max(fwd_cuts.best[k - 1][h], fused_cost[h].seconds)
                if value < best_value:
                    best_h, best_value = h, value
            ranges = None if best_h is None else fwd_cuts.ranges(k - 1, best_h) + ((best_h, n),)
        if ranges is not None:
            forward_options.append(ranges)
    if not forward_options:
        raise PlanError("no forward partition fits the memory budget")  # single layers were checked, so unexpected
    seeds = [(_cuts_of(f), _cuts_of(f)) for f in forward_options]  # the same cuts both ways
    if not search.recompute:
        return seeds
    bwd_cuts = _min_max_cuts(model, "backward", cap, k_limit)
    for forward in forward_options:
        end = forward[-1][0] if fused_last else n  # backward stages cover the layers below the fused stage
        if end == 0:
            seeds.append((_cuts_of(forward), ()))
            continue
        for k in range(1, min(bwd_cuts.max_stages, end) + 1):
            ranges = bwd_cuts.ranges(k, end)
            if ranges is not None:
                seeds.append((_cuts_of(forward), _cuts_of(ranges)))
    return seeds


def _auto_plan(
    model: StageCostModel,
    num_workers: int,
    *,
    cap: float,
    fused_last: bool,
    recompute: bool,
    overhead_s: float,
    max_stages: int | None,
    starts: int = 8,
) -> Plan:
    """Every plan when there are at most ``EXHAUSTIVE_PLANS``; otherwise balanced seeds, all
    priced, the ``starts`` fastest improved by local search. Of every plan priced, the fewest
    stages among those within ``TIE_TOLERANCE`` of the fastest wins (then the fastest).
    """
    search = _Search(model, num_workers, cap, fused_last, recompute, overhead_s)
    if search.space_size() <= EXHAUSTIVE_PLANS:  # few layers: try every plan
        every = list(search.every_plan())
        return search.plan(*_pick(search, every))
    seeds = _seed_plans(model, search, max_stages or max(4 * num_workers, 8))
    seeds = [s for s in dict.fromkeys(search.normalise(*seed) for seed in seeds) if s is not None]
    priced = sorted(seeds, key=lambda s: (search.step_s(*s), _num_stages(s)))
    for start in priced[:starts]:
        search.improve(*start)
    # Every plan priced on the way is a candidate, so near-ties with fewer stages are not lost.
    return search.plan(*_pick(search, list(search.seen)))


def _pick(search: _Search, plans) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Among plans within TIE_TOLERANCE of the fastest, the fewest stages, then the fastest."""
    fastest = min(search.step_s(*p) for p in plans)
    if fastest == INF:
        raise PlanError("no partition fits the memory budget")  # single layers were checked, so unexpected
    near = [p for p in plans if search.step_s(*p) <= fastest * (1 + TIE_TOLERANCE)]
    return min(near, key=lambda p: (_num_stages(p), search.step_s(*p)))


# --------------------------------------------------------------------- entry point
def _manual_ranges(name: str, ranges) -> tuple[LayerRange, ...]:
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
    max_stages: int | None = None,
) -> Plan:
    """Build and validate a plan with ``policy`` ("auto", "uniform", "params" or "manual").

    Args:
        costs: per-layer costs (estimated or measured), one :class:`~.cost.LayerCost` per layer.
        num_workers: size of the worker pool.
        microbatches: microbatches per step.
        memory_budget_bytes: device memory one worker may use; every stage must fit in half of
            it (see the module doc). ``None`` means unlimited.
        link_bytes_per_second: host <-> worker bandwidth per direction; defaults to
            ``costs.notes["link_bytes_per_second"]``; ``None`` there too means free transfers.
        fused_last: the last stage runs forward, loss and backward at once; it is both the last
            forward and the last backward stage.
        recompute: backward recomputes each stage's forward; ``False`` keeps the forward graph,
            so backward stages must equal forward stages.
        manual_forward, manual_backward: ``[[start, end], ...]`` for the manual policy
            (``manual_backward`` defaults to the forward cuts).
        stage_overhead_s: fixed cost per dispatched stage in the timing model.
        max_stages: auto only: most stages per direction of the balanced starting points
            (default ``4 * num_workers``, at least 8; more when the memory budget needs it); the
            local search may split further when that is predicted faster.

    Returns:
        The validated plan; ``plan.notes`` holds the policy and the predictions.
    """
    _check_inputs(costs, num_workers, microbatches)
    if policy not in POLICIES:
        raise PlanError(f"unknown partition policy {policy!r}; use one of {', '.join(repr(p) for p in POLICIES)}")
    n = len(costs)
    link = link_speed(costs, link_bytes_per_second)
    model = StageCostModel(costs, microbatches, link, recompute)
    _check_layers_fit(model, memory_budget_bytes, fused_last)

    if policy == "manual":
        forward = _manual_ranges("manual_forward", manual_forward)
        backward = _manual_ranges("manual_backward", manual_backward) if manual_backward is not None else forward
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
        plan = _auto_plan(
            model,
            num_workers,
            cap=_stage_cap(memory_budget_bytes),
            fused_last=fused_last,
            recompute=recompute,
            overhead_s=stage_overhead_s,
            max_stages=max_stages,
        ).validate()
    _check_plan_fits(plan, model, memory_budget_bytes)

    prediction = predict(
        plan, costs, num_workers, microbatches, link_bytes_per_second=link, stage_overhead_s=stage_overhead_s, recompute=recompute
    )
    notes = {
        "policy": policy,
        "num_workers": num_workers,
        "microbatches": microbatches,
        "stage_seconds": prediction.stage_seconds,
        "stage_memory_bytes": prediction.stage_memory_bytes,
        "predicted_step_s": prediction.step_s,
        "predicted_bubble": prediction.bubble,
        "link_bytes_per_second": link,
        "stage_overhead_s": stage_overhead_s,
        "recompute": recompute,
    }
    if memory_budget_bytes is not None:
        notes["memory_budget_bytes"] = memory_budget_bytes
    if fused_last:
        notes["fused_stage"] = plan.forward_stages()[-1].name
    return Plan(plan.num_layers, plan.forward, plan.backward, plan.fused_last, notes=notes).validate()


# --------------------------------------------------------------------- re-planning
class Replanner:
    """Keeps the current plan and the costs it was built from; re-plans when the costs move.

    ``options`` are passed to :func:`partition` (memory budget, link, fused_last, ...); those not
    given are taken from ``plan.notes`` where :func:`partition` recorded them. Only the ``auto``
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
        self.policy = policy or plan.notes.get("policy", "auto")
        options.setdefault("fused_last", plan.fused_last)
        for key in ("memory_budget_bytes", "link_bytes_per_second", "stage_overhead_s", "recompute"):
            if key in plan.notes and plan.notes[key] is not None:
                options.setdefault(key, plan.notes[key])  # plan again under the same assumptions
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
            keys = ("link_bytes_per_second", "stage_overhead_s", "recompute")
            opts = {k: self.options[k] for k in keys if k in self.options}
            old_s = predict(old_plan, new_costs, self.num_workers, self.microbatches, **opts).step_s
            new_s = new_plan.notes["predicted_step_s"]
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
            format_seconds(new_plan.notes["predicted_step_s"]),
        )
        return None if same else new_plan


__all__ = [
    "DEFAULT_STAGE_OVERHEAD_S",
    "POLICIES",
    "Prediction",
    "Replanner",
    "dispatched_stage_costs",
    "link_speed",
    "partition",
    "predict",
]
