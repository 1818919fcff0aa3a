"""Step graphs lowered once, then turned and re-numbered for later calls (the engine's and the simulator's).

Every call of one plan lowers it with the same options; only two inputs change from call to
call: the worker the round robin starts on (a turn of every task's worker) and the serial of
the call's first stage, which only orders transfer priorities (``passes.py``: an upload's
priority is ``serial * UPLOAD_STRIDE + class``, a download's ``class * DOWNLOAD_STRIDE + serial``;
computes and releases do not depend on it). So the graph lowered once serves every later call,
its workers turned and its transfer priorities moved by the difference in serials: the same
graph ``lower`` returns (``tests/schedule/test_lowered_steps.py`` checks it), without lowering
and validating it again. The engine keeps one ``LoweredSteps`` per kind of call
(``engine/step_context.py``): lowering the quick CPU benchmark's 69 tasks took 1.1-1.3 ms of the
host thread at the start of every step, before any lane could start.
"""

from __future__ import annotations

import copy
import dataclasses

from .dispatch_order import ROUND_ROBIN
from .lowering import UPLOAD_STRIDE, LoweringOptions, TaskGraph, TaskKind, lower
from .plan import Plan


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
