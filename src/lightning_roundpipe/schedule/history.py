"""Where the next dispatch continues, and what each worker did recently: state that spans steps.

The lowering (``lowering``) expresses a step's memory bounds as waits on a worker's
history ("the release two back"), because the entries they name may belong to an earlier call
or step. ``WorkerHistory`` is that history, for any kind of handle: the engine records
``Completion`` objects, the simulator its
operations. Readers record as they submit, in the graph's order, so both resolve a wait to
the same task.
"""

from __future__ import annotations

import collections
from typing import Callable, Generic, TypeVar

from .lowering import GraphTask, TaskGraph, TaskKind

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
