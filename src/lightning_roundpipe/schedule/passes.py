"""The lowering's four passes, each followed by its validator (the rules are in ``lowering``'s doc).

1. ``computes``: which compute tasks a dispatched stage runs (kind, grain, phase, worker);
2. ``transfers``: the uploads and downloads around them, with their dependencies, in
   submission order (this pass numbers the tasks);
3. ``waits``: the memory bounds, as waits on the worker's history;
4. ``priorities``: the transfer lanes' order.

Each pass only adds what its name says, so a change to one rule (a dependency, a bound, an
order) is made and checked in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .graph_task import TaskKind
from .plan import DispatchedStage, Plan, PlanError, Stage

from . import graph_task  # the graph's data types and constants (lowering calls these passes)

if TYPE_CHECKING:
    from .graph_task import GraphTask, Sizes
    from .step_options import LoweringOptions

WAIT_HISTORIES = ("release", "compute", "outputs")  # the histories of .history.WorkerHistory


@dataclass(frozen=True)
class StageComputes:
    """Pass 1's output for one dispatched stage: its computes, one per microbatch."""

    stage: Stage
    worker: int
    serial: int  # place in the dispatch sequence across steps (transfer priorities)
    phase: str  # the host call that submits it: "forward" or "backward"
    kind: str  # "forward", "fused" or "backward"
    grain: str  # "", "stage" or "layer" (backward and fused computes that recompute)


# --------------------------------------------------------------------- 1. computes
def computes(plan: Plan, dispatched: list[DispatchedStage], options: "LoweringOptions", fused: bool) -> list[StageComputes]:
    """Each dispatched stage's compute kind, grain and phase (a fused run submits everything in forward)."""
    n_forward = len(plan.forward)
    out = []
    for k, task in enumerate(dispatched):
        stage = task.stage
        if stage.direction == "F":
            kind = "fused" if fused and stage.index == n_forward - 1 else "forward"
            phase = "forward"
        else:
            kind, phase = "backward", "forward" if fused else "backward"
        grain = ""
        if kind in (TaskKind.BACKWARD, TaskKind.FUSED) and options.training and options.recompute:
            grain = "layer" if options.layer_recompute else "stage"
        out.append(StageComputes(stage, task.worker, options.first_serial + k, phase, kind, grain))
    return check_computes(out, plan, fused)


def check_computes(stages: list[StageComputes], plan: Plan, fused: bool) -> list[StageComputes]:
    """Refuse stage computes the plan does not allow (a stage twice, a fused compute other than the
    plan's fused last stage, a backward compute of a forward stage); returns them unchanged."""
    names = [s.stage.name for s in stages]
    if len(set(names)) != len(names):
        raise PlanError(f"a stage is dispatched twice in one call: {names}")
    for s in stages:
        if (s.kind == TaskKind.FUSED) != (fused and s.stage.name == plan.fused_stage):
            raise PlanError(f"stage {s.stage} computes {s.kind!r}; only the plan's fused last stage runs fused")
        if s.kind == TaskKind.BACKWARD and s.stage.direction != "B":
            raise PlanError(f"forward stage {s.stage} cannot run a backward compute")
    return stages


# --------------------------------------------------------------------- 2. transfers
class _Transfers:
    """Builds the tasks in submission order; priorities and waits are left to passes 3 and 4."""

    def __init__(self, plan: Plan, sizes: "Sizes", options: "LoweringOptions") -> None:
        self.plan, self.sizes, self.o = plan, sizes, options
        self.tasks: list[GraphTask] = []
        self.acts: dict[tuple[int, int], int] = {}  # (boundary, mb) -> download that brought it home
        self.grads: dict[tuple[int, int], int] = {}
        self.forward_worker: dict[int, int] = {}  # kept graphs: forward stage index -> the worker holding it

    def add(self, worker, lane, kind, stage: Stage, mb, nbytes, deps, phase, boundary=-1, layers=None,
            grain="") -> int:
        tid = len(self.tasks)
        self.tasks.append(graph_task.GraphTask(tid, worker, lane, kind, stage.name, mb, int(nbytes), tuple(deps), 0, phase,
                                          stage.start, stage.end, boundary, (), layers, grain))
        return tid

    def stage(self, s: StageComputes) -> None:
        o, stage, worker, phase, kind = self.o, s.stage, s.worker, s.phase, s.kind
        keep = o.training and not o.recompute
        backward = stage.direction == "B"
        kept_backward = backward and keep and o.kept_backward
        weights = [] if kept_backward else [
            self.add(worker, "upload", "weights", stage, -1, nbytes, (), phase, layers=(a, b))
            for a, b, nbytes in self.sizes.weight_chunks(stage.start, stage.end)]
        saves = ([b for b in self.plan.saved_boundaries() if stage.start < b < stage.end]
                 if stage.direction == "F" and o.training and o.recompute and kind == TaskKind.FORWARD else [])
        computed = []
        for i in range(o.microbatches):
            inputs = []
            if not kept_backward:
                inputs.append(self.upload(worker, "act_in", stage, i, stage.start, self.acts, phase))
            if backward:
                inputs.append(self.upload(worker, "grad_in", stage, i, stage.end, self.grads, phase))
            last = self.add(worker, "compute", kind, stage, i, 0, weights + inputs, phase, grain=s.grain)
            computed.append(last)
            if kind == TaskKind.FUSED:
                self.add(worker, "download", "loss", stage, i, graph_task.LOSS_BYTES, (last,), phase)
            if kind == TaskKind.FORWARD:
                for b in [stage.end] + saves:
                    self.acts[(b, i)] = self.add(worker, "download", "act_out" if b == stage.end else "act_save",
                                                 stage, i, self.sizes.boundary_bytes(b), (last,), phase, b)
            elif stage.start > 0 or o.input_gradient:
                self.grads[(stage.start, i)] = self.add(worker, "download", "grad_out", stage, i,
                                                        self.sizes.boundary_bytes(stage.start), (last,), phase,
                                                        stage.start)
        if kind == TaskKind.FORWARD:
            if keep:
                self.forward_worker[stage.index] = worker
                return  # the kept graph holds the weights until this stage's backward
            self.add(worker, "download", "release", stage, -1, 0, (computed[-1],), phase)
            return
        # The weight gradients are the sum over every microbatch's compute, so the download depends
        # on each of them: a failure on any microbatch reaches the host's wait for the gradients
        # (on the last one alone, a failed microbatch whose failure feeds nothing else was lost).
        wgrad_deps = tuple(computed)
        wgrads = [self.add(worker, "download", "wgrad", stage, -1, nbytes, wgrad_deps, phase, layers=(a, b))
                  for a, b, nbytes in self.sizes.grad_chunks(stage.start, stage.end)]
        deps = tuple(wgrads) or (computed[-1],)
        if kept_backward:
            # The kept weights live on the forward's worker (the CPU backend's workers share memory).
            self.add(self.forward_worker[stage.index], "download", "free_kept", stage, -1, 0, deps, phase)
        else:
            self.add(worker, "download", "release", stage, -1, 0, deps, phase)

    def upload(self, worker, kind, stage: Stage, mb: int, boundary: int, sources: dict, phase: str) -> int:
        """An activation (or gradient) upload: after the download that brought it home, if this step made it."""
        src = sources.get((boundary, mb))
        return self.add(worker, "upload", kind, stage, mb, self.sizes.boundary_bytes(boundary),
                        () if src is None else (src,), phase, boundary)


def transfers(plan: Plan, stages: list[StageComputes], sizes: "Sizes", options: "LoweringOptions") -> list["GraphTask"]:
    """Every task of the call in submission order: per stage its uploads, computes and downloads."""
    builder = _Transfers(plan, sizes, options)
    for s in stages:
        builder.stage(s)
    return check_transfers(builder.tasks, plan, options)


def check_transfers(tasks: list["GraphTask"], plan: Plan, options: "LoweringOptions") -> list["GraphTask"]:
    """Each input upload reads a download of its boundary (or the caller's data); each compute's
    uploads are its own stage's; each stage's weights come down and go (unless a forward keeps them)."""
    for t in tasks:
        deps = [tasks[d] for d in t.deps]
        if t.kind in (TaskKind.ACT_IN, TaskKind.GRAD_IN):
            for d in deps:
                if d.lane != "download" or d.boundary != t.boundary:
                    raise PlanError(f"task {t.id} ({t.kind} @{t.boundary}) reads task {d.id} ({d.kind} @{d.boundary})")
        if t.lane == "compute":
            for d in deps:
                if d.stage != t.stage or d.lane != "upload":
                    raise PlanError(f"compute task {t.id} of {t.stage} depends on {d.kind} task {d.id} of {d.stage}")
        if t.kind in (TaskKind.WGRAD, TaskKind.LOSS, TaskKind.ACT_OUT, TaskKind.ACT_SAVE, TaskKind.GRAD_OUT) and (
                not deps or any(d.lane != "compute" or d.stage != t.stage for d in deps)):
            raise PlanError(f"download task {t.id} ({t.kind}) of {t.stage} must follow its stage's computes")
    computed = {t.stage for t in tasks if t.lane == "compute"}
    freed = {t.stage for t in tasks if t.kind in (TaskKind.RELEASE, TaskKind.FREE_KEPT)}
    kept = options.training and not options.recompute
    missing = sorted(s for s in computed - freed if not (kept and s.startswith("F")))
    if missing:
        raise PlanError(f"stage(s) {missing} never release their weights")
    return tasks


# --------------------------------------------------------------------- 3. waits
def waits(tasks: list["GraphTask"], options: "LoweringOptions") -> list["GraphTask"]:
    """Memory bounds: a weights upload waits for the release ``prefetch_depth + 1`` back on its worker;
    an input upload for the compute two back (double buffering); a compute for the downloads of
    the compute two back."""
    by_kind = {"weights": (("release", int(options.prefetch_depth) + 1),),
               "act_in": (("compute", graph_task.INPUT_BUFFERS),), "grad_in": (("compute", graph_task.INPUT_BUFFERS),)}
    out = [dataclasses.replace(t, waits=(("outputs", graph_task.INPUT_BUFFERS),) if t.lane == "compute" else by_kind.get(t.kind, ()))
           for t in tasks]
    return check_waits(out)


def check_waits(tasks: list["GraphTask"]) -> list["GraphTask"]:
    """Refuse tasks whose waits name an unknown history or a non-positive distance; returns them unchanged."""
    for t in tasks:
        for history, back in t.waits:
            if history not in WAIT_HISTORIES or back < 1:
                raise PlanError(f"task {t.id} ({t.kind}) waits for {history}-{back}; a wait names one of "
                                f"{list(WAIT_HISTORIES)} at least 1 back")
    return tasks


# --------------------------------------------------------------------- 4. priorities
def priorities(tasks: list["GraphTask"], stages: list[StageComputes], options: "LoweringOptions") -> list["GraphTask"]:
    """Uploads by stage serial, then kind; downloads by kind, then stage serial; releases first of all."""
    rank, serial = options.priorities, {s.stage.name: s.serial for s in stages}

    def priority(t: "GraphTask") -> int:
        if t.lane == "compute":
            return 0  # the compute lane runs in submission order
        if t.kind in (TaskKind.RELEASE, TaskKind.FREE_KEPT):
            return graph_task.RELEASE_PRIORITY
        klass = int(rank[graph_task.PRIORITY_CLASS[t.kind]])
        if t.lane == "upload":
            return serial[t.stage] * graph_task.UPLOAD_STRIDE + klass
        return klass * graph_task.DOWNLOAD_STRIDE + serial[t.stage]

    out = [dataclasses.replace(t, priority=int(priority(t))) for t in tasks]
    return check_priorities(out, rank)


def check_priorities(tasks: list["GraphTask"], rank: dict) -> list["GraphTask"]:
    """Releases go first; with class ranks below the upload stride, the uploads of a stage go before
    the next stage's (the running stage's inputs before a prefetch)."""
    uploads: dict[str, list[int]] = {}
    for t in tasks:
        if t.kind in (TaskKind.RELEASE, TaskKind.FREE_KEPT) and t.priority != graph_task.RELEASE_PRIORITY:
            raise PlanError(f"release task {t.id} has priority {t.priority}; releases go first ({graph_task.RELEASE_PRIORITY})")
        if t.lane == "upload":
            uploads.setdefault(t.stage, []).append(t.priority)
    if not all(0 <= r < graph_task.UPLOAD_STRIDE for r in rank.values()):
        return tasks  # ranks past the stride mix stages on purpose
    ranges = list(uploads.items())
    for (a, pa), (b, pb) in zip(ranges, ranges[1:]):
        if max(pa) >= min(pb):
            raise PlanError(f"an upload of stage {b} (priority {min(pb)}) could overtake one of {a} ({max(pa)})")
    return tasks
