"""Partition policies: turn per-layer costs into a validated :class:`~.plan.Plan`.

Policies:

* ``uniform``: equal layer counts (``plan.simple_plan``);
* ``params``: equal weight bytes (``plan.simple_plan``);
* ``manual``: the user's layer ranges, validated;
* ``auto``: the RoundPipe partitioner. Forward and backward are cut independently so that the
  stages of each direction cost about the same (a heavy stage holds its worker while the rest
  of the round-robin queue waits behind it); the stage counts are chosen by simulating the
  round-robin dispatch of every candidate and keeping the fastest, under a per-worker memory
  budget.

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
* backward starts when the whole forward is done (``loss.backward()`` runs after the forward
  returned), also with a fused last stage.

Memory rule (documented and conservative): a worker holds the stage it runs and the stage it
prefetches, plus one microbatch's activations, so every stage's weights + weight gradients +
one microbatch's activations (see :class:`~.cost.StageCostModel`) must fit in half of
``memory_budget_bytes``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from .cost import CostProfile, StageCost, StageCostModel, format_bytes, format_seconds
from .cost_estimate import cost_change
from .plan import LayerRange, Plan, PlanError, Stage, simple_plan

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


def _simulate(stages: Sequence[StageCost], num_forward: int, num_workers: int, overhead_s: float) -> tuple[float, float, float]:
    """Round-robin list scheduling of one step; returns (step seconds, busy compute seconds, forward end)."""
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
        if k == num_forward:
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
    step, busy, forward_end = _simulate([sc for _, sc in staged], len(plan.forward), num_workers, stage_overhead_s)
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


def _imbalance(seconds: Sequence[float]) -> float:
    """Costliest stage over the mean stage (1.0 is perfectly balanced)."""
    if not seconds:
        return 1.0
    mean = sum(seconds) / len(seconds)
    return max(seconds) / mean if mean > 0 else 1.0


def _balanced_options(options: list[tuple[tuple[LayerRange, ...], list[float]]], tolerance: float):
    """Keep the cuts whose costliest stage is within ``tolerance`` of the mean stage.

    When no option is that balanced (few layers, a very heavy layer, a tight memory budget),
    keep those within ``tolerance`` of the best balance on offer.
    """
    if not options:
        return options
    limit = max(1.0, min(_imbalance(o[1]) for o in options)) * (1.0 + tolerance)
    return [o for o in options if _imbalance(o[1]) <= limit]


# --------------------------------------------------------------------- auto policy
@dataclass(frozen=True)
class _Candidate:
    plan: Plan
    step_s: float
    imbalance: float

    @property
    def num_stages(self) -> int:
        return len(self.plan.forward) + len(self.plan.backward)


def _pick(candidates: list[_Candidate], tie_tolerance: float = 0.01) -> _Candidate:
    """Fastest candidate; among those within ``tie_tolerance`` of it, the most balanced, then the fewest stages."""
    fastest = min(c.step_s for c in candidates)
    near = [c for c in candidates if c.step_s <= fastest * (1 + tie_tolerance)]
    return min(near, key=lambda c: (round(c.imbalance, 6), c.num_stages, c.step_s, c.plan.to_text()))


def _auto_plan(
    model: StageCostModel,
    num_workers: int,
    *,
    cap: float,
    fused_last: bool,
    recompute: bool,
    overhead_s: float,
    balance_tolerance: float,
    max_stages: int | None,
) -> Plan:
    n = len(model.costs)
    k_limit = max_stages or max(4 * num_workers, 8)
    fwd_table = _cost_table(model, "forward", cap)
    fwd_cuts = _Cuts(fwd_table, n, k_limit)
    if all(fwd_cuts.best[k][n] == INF for k in range(1, fwd_cuts.max_stages + 1)):
        fwd_cuts = _Cuts(fwd_table, n, n)  # the budget needs more stages than the usual limit
    fused_cost = [model.stage("fused", h, n) for h in range(n)] if fused_last else []

    # Forward candidates: one per stage count (with a fused stage, the best place for it).
    forward_options: list[tuple[tuple[LayerRange, ...], list[float]]] = []
    for k in range(1, fwd_cuts.max_stages + 1):
        if not fused_last:
            ranges = fwd_cuts.ranges(k, n)
        elif k == 1:
            ranges = ((0, n),) if fused_cost[0].memory_bytes <= cap else None
        else:
            best_h, best_value = None, INF
            for h in range(k - 1, n):
                if fused_cost[h].memory_bytes > cap:
                    continue
                value = max(fwd_cuts.best[k - 1][h], fused_cost[h].seconds)
                if value < best_value:
                    best_h, best_value = h, value
            ranges = None if best_h is None else fwd_cuts.ranges(k - 1, best_h) + ((best_h, n),)
        if ranges is not None:
            # Balance is judged among plain forward stages; the fused stage is backward-like
            # (forward + backward of its layers) and is balanced with the backward stages below.
            plain = ranges[:-1] if fused_last else ranges
            forward_options.append((ranges, [fwd_table[a][b] for a, b in plain]))
    if not forward_options:
        raise PlanError("no forward partition fits the memory budget")  # single layers were checked, so unexpected
    forward_options = _balanced_options(forward_options, balance_tolerance)

    def candidate(forward: tuple[LayerRange, ...], backward: tuple[LayerRange, ...], imbalance: float) -> _Candidate:
        plan = Plan(n, forward, backward, fused_last=fused_last)
        staged = dispatched_stage_costs(plan, model)
        step, _, _ = _simulate([sc for _, sc in staged], len(forward), num_workers, overhead_s)
        return _Candidate(plan, step, imbalance)

    if not recompute:  # the forward graph is kept: backward must use the forward cuts
        return _pick([candidate(f, f, _imbalance(s)) for f, s in forward_options]).plan

    # The two phases are separated by the barrier at loss.backward(), so rank forward cuts on
    # the forward phase alone and pair only the best few with every backward option.
    def forward_phase_s(option) -> float:
        ranges = option[0]
        plan = Plan(n, ranges, ranges, fused_last=fused_last)
        staged = dispatched_stage_costs(plan, model)[: len(ranges)]
        return _simulate([sc for _, sc in staged], len(ranges), num_workers, overhead_s)[0]

    ranked = sorted(forward_options, key=lambda o: (forward_phase_s(o), _imbalance(o[1]), len(o[0])))
    bwd_table = _cost_table(model, "backward", cap)
    bwd_cuts = _Cuts(bwd_table, n, k_limit)
    if all(bwd_cuts.best[k][n] == INF for k in range(1, bwd_cuts.max_stages + 1)):
        bwd_cuts = _Cuts(bwd_table, n, n)
    candidates = []
    for forward, f_seconds in ranked[:4]:
        end = forward[-1][0] if fused_last else n  # backward stages cover the layers below the fused stage
        tail = (forward[-1],) if fused_last else ()
        if end == 0:
            candidates.append(candidate(forward, tail, _imbalance(f_seconds)))
            continue
        backward_options = []
        for k in range(1, min(bwd_cuts.max_stages, end) + 1):
            ranges = bwd_cuts.ranges(k, end)
            if ranges is not None:
                backward_options.append((ranges, [bwd_table[a][b] for a, b in ranges]))
        if fused_last:
            fused_s = fused_cost[end].seconds
            backward_options = [(r, s + [fused_s]) for r, s in backward_options]
        for backward, b_seconds in _balanced_options(backward_options, balance_tolerance):
            imbalance = max(_imbalance(f_seconds), _imbalance(b_seconds))
            candidates.append(candidate(forward, backward + tail, imbalance))
    if not candidates:
        raise PlanError("no backward partition fits the memory budget")  # single layers were checked, so unexpected
    return _pick(candidates).plan


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
    balance_tolerance: float = 0.1,
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
        balance_tolerance: auto only: stage counts whose costliest stage exceeds the mean stage
            of its direction by more than this share are skipped (when any count qualifies).
        max_stages: auto only: most stages per direction to consider (default ``4 * num_workers``,
            at least 8; more when the memory budget needs it).

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
            balance_tolerance=balance_tolerance,
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
