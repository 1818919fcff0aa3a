"""What spans the calls of one schedule: the dispatch cursor, each worker's recent tasks, the graphs lowered once.

The lowering expresses a step's memory bounds as waits on a worker's history ("the release two
back"), because the entries they name may belong to an earlier call or step. ``WorkerHistory``
is that history, for any kind of handle (the engine records ``Completion`` objects, the simulator
its operations); readers record as they submit, in the graph's order, so both resolve a wait to
the same task. ``LoweredSteps`` lowers a step graph once and turns and re-numbers it for later
calls: lowering the quick CPU benchmark's 69 tasks took 1.1-1.3 ms of the host thread per step.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Callable, Generic, TypeVar

from .dispatch_order import ROUND_ROBIN
from .lowering import UPLOAD_STRIDE, GraphTask, LoweringOptions, TaskGraph, TaskKind, lower
from .plan import Plan

H = TypeVar("H")
HISTORIES = ("release", "compute", "outputs")
OUTPUT_KINDS = ("act_out", "act_save", "grad_out", "loss")  # what a compute sends home for other stages
KEEP = 8  # entries kept per worker and history (waits reach at most prefetch_depth + 1 back)


class WorkerHistory(Generic[H]):
    """Per worker: recent releases, computes and each compute's downloads; plus the dispatch cursor."""

    def __init__(self, num_workers: int, keep: int = KEEP) -> None:
        self.num_workers = num_workers
        self.keep = keep
        self.next_worker = 0  # round-robin continues across calls and steps
        self.next_serial = 0  # stage serials order transfer priorities across steps
        self._entries = {h: [collections.deque(maxlen=keep) for _ in range(num_workers)] for h in HISTORIES}

    def advance(self, graph: TaskGraph) -> None:
        """Move the cursor past a lowered graph's stages."""
        self.next_worker, self.next_serial = graph.next_worker, graph.next_serial

    def record(self, task: GraphTask, handle: H) -> None:
        """Note a submitted task: computes open a new output group, downloads of data join the latest."""
        w = task.worker
        if task.lane == "compute":
            self._entries["compute"][w].append(handle)
            self._entries["outputs"][w].append([])
        elif task.kind == TaskKind.RELEASE:
            self._entries["release"][w].append(handle)
        elif task.kind in OUTPUT_KINDS and self._entries["outputs"][w]:
            self._entries["outputs"][w][-1].append(handle)

    def resolve(self, task: GraphTask, usable: Callable[[H], bool] = lambda h: True) -> list[H]:
        """The handles ``task``'s waits name, now (before ``task`` itself is recorded)."""
        out: list[H] = []
        for history, back in task.waits:
            if back < 1:
                continue
            entries = self._entries[history][task.worker]
            if len(entries) < back:
                continue
            entry = entries[-back]
            for h in (entry if history == "outputs" else (entry,)):
                if usable(h):
                    out.append(h)
        return out

# Every call of one plan lowers it with the same options; only two inputs change from call to call:
# the worker the round robin starts on (a turn of every task's worker) and the serial of the call's
# first stage, which only orders transfer priorities (``passes.py``: an upload's priority is
# ``serial * UPLOAD_STRIDE + class``, a download's ``class * DOWNLOAD_STRIDE + serial``; computes and
# releases do not depend on it). So the graph lowered once serves every later call, its workers
# turned and its transfer priorities moved by the difference in serials: the same graph ``lower``
# returns (``tests/schedule/test_lowered_steps.py``), without lowering and validating it again.
# The engine keeps one ``LoweredSteps`` per kind of call (``StepContext.lower`` in ``engine/step.py``).


class LoweredSteps:
    """``graph(first_worker, first_serial)``: ``lower(plan, num_workers, first_worker, sizes, options)``
    with ``options.first_serial = first_serial``; lowered once in all under round robin (another start
    worker is the same graph with every worker turned by the difference, since round robin gives
    stage ``k`` worker ``(first + k) % num_workers`` and the passes only compare workers), else once
    per start worker."""

    def __init__(self, plan: Plan, num_workers: int, sizes, options: LoweringOptions) -> None:
        self.plan, self.num_workers, self.sizes, self.options = plan, num_workers, sizes, options
        self._lowered: dict[int, tuple[int, int, TaskGraph]] = {}  # key -> (first worker, first serial, graph)
        self._turns = options.schedule is ROUND_ROBIN
        self.lowerings = 0

    def graph(self, first_worker: int, first_serial: int) -> TaskGraph:
        """The step graph dispatched from ``first_worker`` whose first stage has serial ``first_serial``."""
        key = 0 if self._turns else first_worker
        entry = self._lowered.get(key)
        if entry is None:
            entry = (first_worker, first_serial, lower(self.plan, self.num_workers, first_worker, self.sizes,
                                                       dataclasses.replace(self.options, first_serial=first_serial)))
            self._lowered[key] = entry
            self.lowerings += 1
        worker, serial, base = entry
        turn, shift = (first_worker - worker) % self.num_workers, first_serial - serial
        if turn == 0 and shift == 0:
            return base
        nw = self.num_workers
        return dataclasses.replace(
            base, tasks=tuple(_moved(t, turn, nw, shift) for t in base.tasks), next_serial=base.next_serial + shift,
            next_worker=(base.next_worker + turn) % nw,
            stage_workers={name: (w + turn) % nw for name, w in base.stage_workers.items()})


def _moved(task, turn: int, num_workers: int, shift: int):
    """``task`` on the worker ``turn`` places on, as lowered with its stage's serial ``shift`` later."""
    moved = copy.copy(task)
    if turn:
        object.__setattr__(moved, "worker", (task.worker + turn) % num_workers)
    if shift and task.lane != "compute" and task.kind not in (TaskKind.RELEASE, TaskKind.FREE_KEPT):
        step = shift * UPLOAD_STRIDE if task.lane == "upload" else shift
        object.__setattr__(moved, "priority", task.priority + step)
    return moved
