"""The ``auto`` policy's search: plans as cut positions, priced by the timing model.

It starts from balanced cuts (for every stage count, forward and backward cut independently
so that the stages of each direction cost about the same: a heavy stage holds its worker
while the rest of the round-robin queue waits behind it), prices every pairing, then
improves the fastest few by local moves (shift one cut by a layer, merge two neighbouring
stages, split one) as long as the predicted step gets shorter; models with few layers are
searched exhaustively. Plans within 2% of the fastest count as tied and the one with the
fewest stages wins (``TIE_TOLERANCE``). Balanced cuts alone are not enough: with a fused last
stage the backward stages run alongside it, so the best cuts are the ones that keep every
worker busy, not the ones that equalise each direction.
"""

from __future__ import annotations

from typing import Sequence

from ..cost.profile import StageCost, StageCostModel
from .cuts import MinMaxCuts
from ..schedule.dispatch_order import ROUND_ROBIN, Schedule
from ..schedule.plan import LayerRange, Plan, PlanError
from ..setup_progress import ProgressCallback, report
from .predictor import dispatched_stage_costs, list_schedule

INF = float("inf")
MAX_EVALUATIONS = 6000  # plans the local search may simulate (about 1.5 s for 40 layers on 8 workers)
EXHAUSTIVE_PLANS = 6000  # plan spaces up to this size are searched exhaustively (exact optimum; < 1 s)
# Plans predicted within this share of the fastest count as tied, and the one with the fewest
# stages wins: measured costs are noisy at this level, and every stage adds tasks, transfers and
# hand-overs between workers that the timing model does not price (on the 2-core CPU benchmark a
# plan with 4 more stages, predicted 0.2% faster, ran 5% slower).
TIE_TOLERANCE = 0.02
SEARCH_PHASE = "RoundPipe: searching plans"
PROGRESS_EVERY = 100  # plans priced between two progress reports


class Search:
    """Plans as cut positions, priced by the timing model; memoised.

    A plan is ``(fcuts, bcuts)``: the interior layer boundaries of the forward and the backward
    stages (sorted tuples). With a fused last stage the last forward cut ``h`` is where the fused
    stage starts; the backward stages are ``bcuts`` (all below ``h``) plus ``h``. Without
    recompute the backward cuts are the forward cuts.

    ``progress(SEARCH_PHASE, priced, budget)`` hears every ``PROGRESS_EVERY`` plans priced;
    ``budget`` is the whole space when it is searched exhaustively, else ``MAX_EVALUATIONS``.
    """

    def __init__(self, model: StageCostModel, num_workers: int, cap: float, fused_last: bool, recompute: bool,
                 overhead_s: float, progress: ProgressCallback | None = None,
                 microbatch_overhead_s: float = 0.0, schedule: Schedule = ROUND_ROBIN) -> None:
        self.model, self.num_workers, self.cap, self.schedule = model, num_workers, cap, schedule
        self.fused_last, self.recompute, self.overhead_s = fused_last, recompute, overhead_s
        self.microbatch_overhead_s = microbatch_overhead_s
        self.n = len(model.costs)
        self.exhaustive = self.space_size() <= EXHAUSTIVE_PLANS
        self.budget = self.space_size() if self.exhaustive else MAX_EVALUATIONS
        self.progress = progress
        self.seen: dict[tuple, float] = {}
        self._stages: dict[tuple, StageCost] = {}

    def stage(self, kind: str, a: int, b: int) -> StageCost:
        """``model.stage``, memoised (the search prices the same stages over and over)."""
        key = (kind, a, b)
        if key not in self._stages:
            self._stages[key] = self.model.stage(kind, a, b)
        return self._stages[key]

    def ranges(self, cuts: tuple[int, ...]) -> tuple[LayerRange, ...]:
        """The layer ranges that ``cuts`` (inner boundaries) make."""
        bounds = (0,) + cuts + (self.n,)
        return tuple((bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1))

    def plan(self, fcuts: tuple[int, ...], bcuts: tuple[int, ...]) -> Plan:
        """The plan of forward cuts ``fcuts`` and backward cuts ``bcuts`` (the forward ones without recompute)."""
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
        """Predicted step time of the plan of these cuts (cached)."""
        key = (fcuts, bcuts)
        if key in self.seen:
            return self.seen[key]
        plan = self.plan(fcuts, bcuts)
        staged = [sc for _, sc in dispatched_stage_costs(plan, self, self.schedule)]
        if any(sc.memory_bytes > self.cap for sc in staged):
            value = INF  # some stage breaks the memory budget
        else:
            workers = [t.worker for t in self.schedule.dispatch(plan, self.num_workers)]
            value = list_schedule(staged, workers, len(plan.forward), self.num_workers, self.overhead_s,
                                  barrier=not self.fused_last, microbatch_overhead_s=self.microbatch_overhead_s)[0]
        self.seen[key] = value
        if len(self.seen) % PROGRESS_EVERY == 0:
            report(self.progress, SEARCH_PHASE, min(len(self.seen), self.budget - 1), self.budget)
        return value

    def finished(self) -> None:
        """Tell ``progress`` the search is done (it may end before the budget is spent)."""
        report(self.progress, SEARCH_PHASE, self.budget, self.budget)

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
        """Every ``(fcuts, bcuts)`` the search considers."""
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
        """Steepest descent over ``neighbours`` until no move shortens the predicted step."""
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


def _min_max_cuts(model: StageCostModel, kind: str, cap: float, k_limit: int) -> MinMaxCuts:
    """Min-max cuts of one direction for up to ``k_limit`` stages (more when the budget needs them)."""
    n = len(model.costs)
    cuts = MinMaxCuts(_cost_function(model, kind, cap), n, k_limit)
    if all(cuts.best[k][n] == INF for k in range(1, cuts.max_stages + 1)):
        cuts = MinMaxCuts(_cost_function(model, kind, cap), n, n)  # the budget needs more stages than the usual limit
    return cuts


def _num_stages(cuts: tuple[tuple[int, ...], tuple[int, ...]]) -> int:
    return len(cuts[0]) + len(cuts[1])


def _seed_plans(model: StageCostModel, search: Search, k_limit: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
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


def auto_plan(
    model: StageCostModel,
    num_workers: int,
    *,
    cap: float,
    fused_last: bool,
    recompute: bool,
    overhead_s: float,
    max_stages: int | None,
    starts: int = 8,
    progress: ProgressCallback | None = None,
    microbatch_overhead_s: float = 0.0,
) -> Plan:
    """Every plan when there are at most ``EXHAUSTIVE_PLANS``; otherwise balanced seeds, all
    priced, the ``starts`` fastest improved by local search. Of every plan priced, the fewest
    stages among those within ``TIE_TOLERANCE`` of the fastest wins (then the fastest).
    """
    search = Search(model, num_workers, cap, fused_last, recompute, overhead_s, progress, microbatch_overhead_s)
    if search.exhaustive:  # few layers: try every plan
        every = list(search.every_plan())
        best = _pick(search, every)
        search.finished()
        return search.plan(*best)
    seeds = _seed_plans(model, search, max_stages or max(4 * num_workers, 8))
    seeds = [s for s in dict.fromkeys(search.normalise(*seed) for seed in seeds) if s is not None]
    priced = sorted(seeds, key=lambda s: (search.step_s(*s), _num_stages(s)))
    for start in priced[:starts]:
        search.improve(*start)
    # Every plan priced on the way is a candidate, so near-ties with fewer stages are not lost.
    best = _pick(search, list(search.seen))
    search.finished()
    return search.plan(*best)


def _pick(search: Search, plans) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Among plans within TIE_TOLERANCE of the fastest, the fewest stages, then the fastest."""
    fastest = min(search.step_s(*p) for p in plans)
    if fastest == INF:
        raise PlanError("no partition fits the memory budget")  # single layers were checked, so unexpected
    near = [p for p in plans if search.step_s(*p) <= fastest * (1 + TIE_TOLERANCE)]
    return min(near, key=lambda p: (_num_stages(p), search.step_s(*p)))


def _cost_function(model: StageCostModel, kind: str, cap: float):
    """Seconds of each stage of ``kind`` (inf when it breaks the budget), priced once for the cut routine."""
    n = len(model.costs)
    table = [[INF] * (n + 1) for _ in range(n + 1)]
    for s in range(n):
        for e in range(s + 1, n + 1):
            sc = model.stage(kind, s, e)
            if sc.memory_bytes <= cap:
                table[s][e] = sc.seconds
    return lambda s, e: table[s][e]
