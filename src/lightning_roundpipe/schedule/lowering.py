"""The plan lowered into one training step's task graph, as plain data.

This is the only place where the rules of a RoundPipe step live: dispatch order, per-stage
uploads, computes and downloads, the fused last stage, layer-grain recompute, memory bounds as
waits on the worker's history, and priorities. The executor submits the graph, the simulator
times it, and the partitioner's predictor is checked against it. A task's ``deps`` name earlier
tasks of the graph; its ``waits`` name history entries (``("release", 2)``). The rules one by
one: docs/design.md, design notes, ``schedule/lowering.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from . import passes
from .dispatch_order import ROUND_ROBIN, Schedule
from .plan import Plan, PlanError



class TaskKind(enum.StrEnum):
    """What a task does; the engine's handler table (engine/task_work.py) has one entry per kind."""

    WEIGHTS = "weights"
    ACT_IN = "act_in"
    GRAD_IN = "grad_in"
    FORWARD = "forward"
    FUSED = "fused"
    BACKWARD = "backward"
    ACT_OUT = "act_out"
    ACT_SAVE = "act_save"
    GRAD_OUT = "grad_out"
    LOSS = "loss"
    WGRAD = "wgrad"
    RELEASE = "release"
    FREE_KEPT = "free_kept"


LANES = ("upload", "compute", "download")
LANE_KINDS = {
    "upload": ("weights", "act_in", "grad_in"),
    "compute": ("forward", "fused", "backward"),
    "download": ("act_out", "act_save", "grad_out", "loss", "wgrad", "release", "free_kept"),
}
# Transfer kinds by the priority class (EngineOptions.priorities) they take.
PRIORITY_CLASS = {"weights": "weights", "act_in": "activation", "grad_in": "activation", "act_out": "activation",
                  "act_save": "activation", "grad_out": "activation", "loss": "activation", "wgrad": "gradients"}
DEFAULT_PRIORITIES = {"activation": 0, "weights": 1, "gradients": 2}
UPLOAD_STRIDE = 16  # upload priority = stage serial * UPLOAD_STRIDE + class rank
DOWNLOAD_STRIDE = 1 << 40  # download priority = class rank * DOWNLOAD_STRIDE + stage serial
RELEASE_PRIORITY = -1
LOSS_BYTES = 4  # one fp32 scalar per microbatch
INPUT_BUFFERS = 2  # microbatch inputs a worker may hold ahead of its compute (and outputs behind it)


class Sizes(Protocol):
    """Bytes the graph's transfers move; the lowering decides only how many tasks and in which order."""

    def weight_chunks(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(first layer, end layer, bytes)`` of each weights upload of the stage (one task each, in order)."""

    def grad_chunks(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(first layer, end layer, bytes)`` of each weight-gradient download of the stage."""

    def boundary_bytes(self, boundary: int) -> int:
        """Bytes of one microbatch's activation at a layer boundary (the input of layer ``boundary``)."""


@dataclass(frozen=True)
class LoweringOptions:
    """What, besides the plan, decides a step's graph.

    training: backward stages are lowered too (False: an evaluation forward).
    fused: the plan's fused last stage runs fused (the loss is computed inside the pipeline).
    recompute: False keeps every forward graph until its backward (see the module doc).
    layer_recompute: backward and fused computes recompute one layer at a time (``grain="layer"``).
    kept_backward: with ``recompute`` False, the backward stages run on the kept graphs; False:
        they recompute from the stage inputs on the host, as with recompute (a call's second
        backward: its first one freed the kept graphs).
    input_gradient: the input gradient of layer 0 comes home (the caller's input needs grad).
    first_serial: serial of the first stage, continuing the previous steps' (transfer priorities).
    schedule: which worker runs each stage, and where the next call starts (``dispatch_order``).
    """

    microbatches: int = 2
    training: bool = True
    fused: bool = False
    recompute: bool = True
    layer_recompute: bool = False
    kept_backward: bool = True
    input_gradient: bool = False
    prefetch_depth: int = 1
    priorities: dict = field(default_factory=lambda: dict(DEFAULT_PRIORITIES))
    first_serial: int = 0
    schedule: Schedule = ROUND_ROBIN


@dataclass(frozen=True)
class GraphTask:
    """One task of the step: a transfer or a compute on one lane of one worker."""

    id: int
    worker: int
    lane: str
    kind: TaskKind
    stage: str  # stage name, e.g. "F0" or "B3"
    microbatch: int  # -1 for per-stage tasks
    bytes: int
    deps: tuple[int, ...]  # ids of earlier tasks in this graph
    priority: int  # transfer lanes: lower first; 0 on the in-order compute lane
    phase: str  # "forward" or "backward": the host call that submits it
    start: int  # the stage's layers
    end: int
    boundary: int = -1  # activation transfers: the layer boundary of the carry
    waits: tuple[tuple[str, int], ...] = ()  # (history, back) entries on this worker's history
    layers: tuple[int, int] | None = None  # weight uploads and gradient downloads: the layers they cover
    grain: str = ""  # backward and fused computes that recompute: "stage" or "layer"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", TaskKind(self.kind))

    def to_text(self) -> str:
        """One line: id, kind, stage, microbatch, worker, lane and dependencies."""
        mb = f" mb{self.microbatch}" if self.microbatch >= 0 else ""
        at = f" @{self.boundary}" if self.boundary >= 0 else ""
        deps = f" <- {','.join(map(str, self.deps))}" if self.deps else ""
        waits = "".join(f" wait {h}-{back}" for h, back in self.waits)
        grain = " layer-grain" if self.grain == "layer" else ""
        return (f"{self.id:>4} w{self.worker} {self.lane:<8} {self.kind:<9} {self.stage}[{self.start}:{self.end}]"
                f"{mb}{at} {self.bytes}B p{self.priority}{deps}{waits}{grain}")


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
