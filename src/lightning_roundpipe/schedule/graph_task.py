"""One task of a lowered step's graph, and what it is made of: its kinds, the lanes, priorities.

The data ``lowering`` (which builds the graph) and ``passes`` (its four passes) share, kept below both so
that neither imports the other. ``LANES`` and its rules are the package's one lane definition;
``TaskKind`` names every kind.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


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


# The lanes, defined once for the engine (workers/pool.py), the timing model (cost/graph_timing.py),
# the emulated streams and the trace. Their rules: a worker's compute lane runs its tasks in
# submission order (a fixed gradient accumulation order); its two transfer lanes, the host link's
# two directions, run the ready task of lowest priority first (ties in submission order), in
# chunks, so an urgent one overtakes at a chunk boundary; the host lane (the optimizer's thread)
# runs the ready work of lowest rank first, ties in the order it became ready.
LANES = ("upload", "compute", "download")  # a worker's lanes, in the order a timeline draws them
UPLOAD, COMPUTE, DOWNLOAD = LANES
IN_ORDER_LANES = (COMPUTE,)
TRANSFER_LANES = (UPLOAD, DOWNLOAD)
HOST_LANE = "host"
MAIN_LANE = "main"  # the host's main thread (dispatch, loss, accumulation) where the simulator prices it
TRACE_LANES = (*LANES, HOST_LANE)
LANE_KINDS = {
    UPLOAD: (TaskKind.WEIGHTS, TaskKind.ACT_IN, TaskKind.GRAD_IN),
    COMPUTE: (TaskKind.FORWARD, TaskKind.FUSED, TaskKind.BACKWARD),
    DOWNLOAD: (TaskKind.ACT_OUT, TaskKind.ACT_SAVE, TaskKind.GRAD_OUT, TaskKind.LOSS, TaskKind.WGRAD,
               TaskKind.RELEASE, TaskKind.FREE_KEPT),
}
# Transfer kinds by the priority class (EngineOptions.priorities) they take.
PRIORITY_CLASS = {TaskKind.WEIGHTS: "weights", TaskKind.ACT_IN: "activation", TaskKind.GRAD_IN: "activation",
                  TaskKind.ACT_OUT: "activation", TaskKind.ACT_SAVE: "activation", TaskKind.GRAD_OUT: "activation",
                  TaskKind.LOSS: "activation", TaskKind.WGRAD: "gradients"}
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
