"""Designs the engine does not have, for the simulator to price (``SimConfig(design=...)``).

The simulator runs the engine's design (``EngineDesign``); the studies of this layer price two
changes the engine has not made, kept here so that the simulator models only what runs:
``call_barrier=False`` (an asynchronous ``backward()``) and ``fused_spread=k`` (the fused last
stage's microbatches spread over ``k`` workers). Details: docs/design.md, design notes,
``analysis/designs.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_roundpipe.schedule.lowering import GraphTask
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.cost.graph_timing import LaneWork
from lightning_roundpipe.schedule.graph_task import COMPUTE, DOWNLOAD, UPLOAD
from lightning_roundpipe.sim.simulate import EngineDesign, FusedOnOneWorker


@dataclass(frozen=True)
class PricedDesign(EngineDesign):
    """The engine's design with the changes above (defaults: none)."""

    call_barrier: bool | str = True  # True, "step" or False (EngineDesign)
    fused_spread: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.fused_spread, bool) or not isinstance(self.fused_spread, int) or self.fused_spread < 1:
            raise ValueError(f"fused_spread must be a positive integer, got {self.fused_spread!r}")

    def fused_placement(self, plan: Plan, tasks: list[GraphTask], num_workers: int, microbatches: int):
        """The engine's placement, or the stage spread over ``fused_spread`` workers."""
        if self.fused_spread == 1:
            return FusedOnOneWorker(microbatches)
        return FusedSpread(plan, tasks, num_workers, self.fused_spread, microbatches)


class FusedSpread(FusedOnOneWorker):
    """``PricedDesign.fused_spread``: the fused stage's microbatches on several workers (see there).

    Rewrites the fused stage's per-microbatch tasks onto their workers, copies its weight
    uploads to the extra workers, points each compute at its worker's copy, and gives every
    extra worker its own gradient download after its last microbatch.
    """

    def __init__(self, plan: Plan, tasks: list[GraphTask], num_workers: int, k: int, microbatches: int) -> None:
        self.stage = plan.fused_stage if k > 1 else None
        self.k, self.m = min(k, num_workers), microbatches
        home = next((t.worker for t in tasks if t.stage == self.stage), 0)
        self.workers = [(home - j) % num_workers for j in range(self.k)]
        self.copies: dict[int, list[LaneWork]] = {}  # id of a weights op on the home worker -> its copies
        self.last: dict[int, LaneWork] = {}  # worker -> its last fused compute
        self.extra_wgrads: list[LaneWork] = []

    def spreads(self, t: GraphTask) -> bool:
        return self.stage is not None and t.stage == self.stage

    def task(self, t: GraphTask) -> GraphTask:
        if self.spreads(t) and t.microbatch >= 0:
            return dataclasses.replace(t, worker=self.workers[t.microbatch % self.k])
        return t

    def copy_weights(self, op: LaneWork, add) -> None:
        if not self.spreads_op(op):
            return
        self.copies[id(op)] = [add(LaneWork(w, UPLOAD, op.kind, op.stage, -1, op.step, bytes=op.bytes, priority=op.priority,
                                      deps=list(op.deps), alloc=[(w, op.bytes)])) for w in self.workers[1:]]

    def spreads_op(self, op: LaneWork) -> bool:
        """Whether simulator op ``op`` belongs to the spread stage."""
        return self.stage is not None and op.stage == self.stage

    def compute_deps(self, t: GraphTask, deps: list[LaneWork]) -> list[LaneWork]:
        if not self.spreads(t) or t.worker == self.workers[0]:
            return deps
        j = self.workers.index(t.worker) - 1
        return [self.copies[id(d)][j] if id(d) in self.copies else d for d in deps]

    def first_last(self, t: GraphTask) -> tuple[bool, bool]:
        """Whether ``t`` is the first / last microbatch its worker runs of its stage."""
        if not self.spreads(t):
            return t.microbatch == 0, t.microbatch == self.m - 1
        return t.microbatch < self.k, t.microbatch + self.k >= self.m

    def computed(self, t: GraphTask, op: LaneWork) -> None:
        if self.spreads(t):
            self.last[t.worker] = op

    def wgrads(self, t: GraphTask, deps: list[LaneWork], step: int, add, out: list[tuple[int, LaneWork]]) -> LaneWork:
        """The home worker's gradient download (returned) and one per extra worker (added to ``out``)."""
        # Each worker's download waits for its own last compute (its lane runs them in order),
        # not for the stage's computes on the other workers, which the graph's task depends on.
        others = [d for d in deps if not (d.queue == COMPUTE and d.stage == self.stage)]
        home = LaneWork(t.worker, DOWNLOAD, t.kind, t.stage, -1, step, bytes=t.bytes, priority=t.priority,
                  deps=others + [self.last[self.workers[0]]], free=[(t.worker, t.bytes)])
        for w in self.workers[1:]:
            if w in self.last:
                extra = add(LaneWork(w, DOWNLOAD, t.kind, t.stage, -1, step, bytes=t.bytes, priority=t.priority,
                               deps=others + [self.last[w]], free=[(w, t.bytes)]))
                self.extra_wgrads.append(extra)
                out.append((t.layers[0], extra))
        return home
