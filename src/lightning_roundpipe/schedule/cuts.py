"""Min-max cuts: a layer sequence split into contiguous stages so that the costliest stage is cheapest.

One exact dynamic programme serves the ``params`` policy (:func:`~.plan.balanced_ranges`) and
the ``auto`` partitioner's starting points. ``cost(s, e)`` is the cost of the stage
``[s, e)``; ``inf`` marks a stage that may not exist (it breaks the memory budget).
"""

from __future__ import annotations

from typing import Callable

LayerRange = tuple[int, int]
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
