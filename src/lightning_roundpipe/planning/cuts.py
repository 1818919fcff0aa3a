"""Cuts of a layer sequence into contiguous stages: the min-max dynamic programme and the simple policies.

``MinMaxCuts`` splits so that the costliest stage is cheapest. One exact dynamic programme
serves the ``params`` policy (``balanced_ranges``) and the ``auto`` partitioner's starting
points. ``cost(s, e)`` is the cost of the stage ``[s, e)``; ``inf`` marks a stage that may not exist (it
breaks the memory budget). ``simple_plan`` is the ``uniform`` (``uniform_ranges``) and
``params`` policies.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..schedule.plan import LayerRange, Plan, PlanError, PlanFacts

INF = float("inf")


class MinMaxCuts:
    """Best cuts of every layer prefix ``[0, i)`` into ``j`` stages, for ``j`` up to ``max_stages``.

    ``even_rest``: among cuts with the same largest stage, take the one whose stages are most
    even (smallest sum of squares); otherwise the earliest cut wins a tie. Both are
    deterministic. ``tolerance`` and ``square_tolerance`` are the absolute differences under
    which two largest costs, and two sums of squares, count as equal.
    O(stages * layers^2): fine for the few hundred layers of an LLM.
    """

    def __init__(self, cost: Callable[[int, int], float], num_layers: int, max_stages: int, *,
                 even_rest: bool = False, tolerance: float = 0.0, square_tolerance: float = 0.0) -> None:
        n, k_max = num_layers, max(1, min(max_stages, num_layers))
        self.num_layers, self.max_stages = n, k_max
        self.best = [[INF] * (n + 1) for _ in range(k_max + 1)]  # largest stage cost
        squares = [[INF] * (n + 1) for _ in range(k_max + 1)]
        self.arg = [[-1] * (n + 1) for _ in range(k_max + 1)]
        self.best[0][0] = squares[0][0] = 0.0
        eps = tolerance
        for j in range(1, k_max + 1):
            prev, prev_sq, cur, cur_sq, arg = self.best[j - 1], squares[j - 1], self.best[j], squares[j], self.arg[j]
            for i in range(j, n + 1):
                best_value, best_sq, best_start = INF, INF, -1
                for s in range(j - 1, i):
                    p = prev[s]
                    if p == INF or p > best_value + eps or (not even_rest and p >= best_value):
                        continue  # the stage before s already costs more than the best so far
                    c = cost(s, i)
                    v = p if p > c else c
                    if v == INF:
                        continue
                    if even_rest:
                        sq = prev_sq[s] + c * c
                        if v < best_value - eps or (abs(v - best_value) <= eps and sq < best_sq - square_tolerance):
                            best_value, best_sq, best_start = v, sq, s
                    elif v < best_value:
                        best_value, best_start = v, s
                cur[i], cur_sq[i], arg[i] = best_value, best_sq, best_start

    def ranges(self, stages: int, end: int | None = None) -> tuple[LayerRange, ...] | None:
        """The cuts of ``[0, end)`` (default: every layer) into ``stages`` stages, or None when none fits."""
        end = self.num_layers if end is None else end
        if stages > self.max_stages or self.best[stages][end] == INF:
            return None
        out, i = [], end
        for j in range(stages, 0, -1):
            s = self.arg[j][i]
            out.append((s, i))
            i = s
        return tuple(reversed(out))


# --------------------------------------------------------------------- simple policies
def uniform_ranges(num_layers: int, num_stages: int) -> tuple[LayerRange, ...]:
    """Equal layer counts per stage (the first stages take one more when it does not divide)."""
    num_stages = max(1, min(num_stages, num_layers))
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return tuple(out)


def balanced_ranges(costs: Sequence[float], num_stages: int) -> tuple[LayerRange, ...]:
    """Contiguous split of ``costs`` into ``num_stages`` non-empty ranges minimising the largest sum.

    Among splits with the same largest sum, the one with the smallest sum of squares wins (the
    other stages are as even as they can be); ties prefer earlier cuts (``MinMaxCuts``).
    """
    n = len(costs)
    k = max(1, min(num_stages, n))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    eps = 1e-12 * max(1.0, prefix[-1])
    cuts = MinMaxCuts(lambda s, e: prefix[e] - prefix[s], n, k, even_rest=True, tolerance=eps,
                      square_tolerance=eps * max(1.0, prefix[-1]))
    return cuts.ranges(k)


def simple_plan(
    num_layers: int,
    num_workers: int,
    policy: str = "params",
    layer_weights: Sequence[float] | None = None,
    forward_stages: int | None = None,
    backward_stages: int | None = None,
    same_cuts: bool = False,
    fused_last: bool = False,
) -> Plan:
    """Plan for the ``uniform`` (equal layers) or ``params`` (equal weight bytes) policy.

    By default there are as many forward stages as workers and twice as many backward stages
    (backward with recompute is the heavier pass), capped by the layer count. ``same_cuts`` forces
    backward stages equal to forward ones (needed when the forward graph is kept, recompute="never").
    """
    nf = forward_stages or num_workers
    nb = backward_stages or 2 * num_workers
    if same_cuts:
        nb = nf
    if policy == "uniform" or layer_weights is None:
        split = lambda k: uniform_ranges(num_layers, k)  # noqa: E731
    elif policy == "params":
        if len(layer_weights) != num_layers:
            raise PlanError(f"got {len(layer_weights)} layer weights for {num_layers} layers")
        weights = [max(float(w), 1.0) for w in layer_weights]  # parameter-free layers still cost something
        split = lambda k: balanced_ranges(weights, k)  # noqa: E731
    else:
        raise PlanError(f"unknown simple partition policy {policy!r}; use 'uniform' or 'params'")
    fwd = split(nf)
    bwd = fwd if same_cuts else split(nb)
    if fused_last and bwd[-1] != fwd[-1]:
        # The fused stage's backward is the last forward stage; cut the rest of backward below it.
        head_start = fwd[-1][0]
        if head_start == 0:
            bwd = (fwd[-1],)
        else:
            inner = [(a, min(b, head_start)) for a, b in bwd if a < head_start]
            bwd = tuple(inner) + (fwd[-1],)
    return Plan(num_layers, fwd, bwd, fused_last=fused_last, facts=PlanFacts(policy=policy)).validate()
