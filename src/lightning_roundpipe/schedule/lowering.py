"""The plan lowered into one training step's task graph, as plain data.

This is the only place where the rules of a RoundPipe step live: dispatch order, per-stage
uploads, computes and downloads, the fused last stage, layer-grain recompute, memory bounds as
waits on the worker's history, and priorities. The executor submits the graph, the simulator
times it, and the partitioner's predictor is checked against it. A task's ``deps`` name earlier
tasks of the graph; its ``waits`` name history entries (``("release", 2)``). The rules one by
one: docs/design.md, design notes, ``schedule/lowering.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import passes
from .graph_task import (DEFAULT_PRIORITIES, DOWNLOAD_STRIDE, INPUT_BUFFERS, LANE_KINDS, LANES, LOSS_BYTES,  # noqa: F401
                         PRIORITY_CLASS, RELEASE_PRIORITY, UPLOAD_STRIDE, GraphTask, Sizes, TaskKind)
from .plan import Plan, PlanError
from .step_options import LoweringOptions  # noqa: F401  (where callers of ``lower`` have always found it)


@dataclass(frozen=True)
class TaskGraph:
    """The tasks of one step in submission order, and where the next step's dispatch continues."""

    tasks: tuple[GraphTask, ...]
    num_workers: int
    next_worker: int
    next_serial: int
    stage_workers: dict = field(default_factory=dict, compare=False)  # stage name -> worker

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self):
        return iter(self.tasks)

    def phase(self, name: str) -> list[GraphTask]:
        """The tasks of phase ``name``, in graph order."""
        return [t for t in self.tasks if t.phase == name]

    def to_text(self) -> str:
        """The graph as text, one task per line."""
        return "\n".join(t.to_text() for t in self.tasks)

    def validate(self) -> "TaskGraph":
        """Raise ``PlanError`` naming the first malformed task; return ``self``."""
        for pos, t in enumerate(self.tasks):
            if t.id != pos:
                raise PlanError(f"task {pos} has id {t.id}: ids must be positions in submission order")
            if t.lane not in LANES or t.kind not in LANE_KINDS[t.lane]:
                raise PlanError(f"task {t.id} ({t.kind}) cannot run on the {t.lane!r} lane")
            if not 0 <= t.worker < self.num_workers:
                raise PlanError(f"task {t.id} names worker {t.worker} of {self.num_workers}")
            for d in t.deps:
                if not 0 <= d < t.id:
                    raise PlanError(f"task {t.id} depends on task {d}, which is not submitted before it")
                if self.tasks[d].phase == "backward" and t.phase == "forward":
                    raise PlanError(f"forward-phase task {t.id} depends on backward-phase task {d}")
            if t.bytes < 0:
                raise PlanError(f"task {t.id} moves {t.bytes} bytes")
            if t.lane == "compute":
                # A compute runs where its weights and inputs were uploaded.
                for d in t.deps:
                    src = self.tasks[d]
                    if src.lane == "upload" and src.worker != t.worker:
                        raise PlanError(f"compute task {t.id} on worker {t.worker} uses upload {d} of worker {src.worker}")
        return self


def lower(plan: Plan, num_workers: int, first_worker: int, sizes: Sizes, options: LoweringOptions) -> TaskGraph:
    """The step's task graph: ``plan`` dispatched by ``options.schedule`` from ``first_worker`` (the
    history's cursor), then lowered by the four passes of ``passes`` (see the module doc)."""
    if options.microbatches < 1:
        raise PlanError(f"a step needs at least one microbatch, got {options.microbatches}")
    if options.layer_recompute and not options.recompute:
        raise PlanError("layer-grain recompute needs recompute=True")
    if options.training and not options.recompute and not plan.same_cuts():
        raise PlanError(f"without recompute backward stages must be cut like forward ones; got {plan.to_text()}")
    fused = options.training and options.fused and plan.fused_last
    # The plan's fused stage runs as a plain forward and backward stage when the loss is computed outside.
    dispatched = options.schedule.dispatch(plan, num_workers, first_worker, fused=fused)
    if not options.training:
        dispatched = dispatched[:len(plan.forward)]
    stages = passes.computes(plan, dispatched, options, fused)
    tasks = passes.transfers(plan, stages, sizes, options)
    tasks = passes.waits(tasks, options)
    tasks = passes.priorities(tasks, stages, options)
    next_worker = options.schedule.cursor_after(first_worker, len(dispatched), num_workers)
    return TaskGraph(tuple(tasks), num_workers, next_worker, options.first_serial + len(dispatched),
                     {s.stage.name: s.worker for s in stages}).validate()
