"""A simulation's step graphs, lowered once per dispatch start and re-numbered for later steps.

Every simulated step lowers the same plan with the same options; only two inputs change from
step to step: the worker the round robin starts on (which repeats, since a step dispatches the
same number of stages) and the serial of the step's first stage, which only orders transfer
priorities (``schedule/passes.py``: an upload's priority is ``serial * UPLOAD_STRIDE + class``,
a download's ``class * DOWNLOAD_STRIDE + serial``; computes and releases do not depend on it).
So the graph lowered for a start worker serves every later step that starts there, its
transfer priorities moved by the difference in serials: the same graph ``lower`` returns
(``tests/sim/test_lowered_steps.py`` checks it), without lowering and validating it again.
"""

from __future__ import annotations

import copy
import dataclasses

from ..schedule.lowering import UPLOAD_STRIDE, LoweringOptions, TaskGraph, lower
from ..schedule.plan import Plan


class LoweredSteps:
    """``graph(first_worker, first_serial)``: ``lower(plan, num_workers, first_worker, sizes, options)``
    with ``options.first_serial = first_serial``, lowered once per ``first_worker``."""

    def __init__(self, plan: Plan, num_workers: int, sizes, options: LoweringOptions) -> None:
        self.plan, self.num_workers, self.sizes, self.options = plan, num_workers, sizes, options
        self._lowered: dict[int, TaskGraph] = {}
        self.lowerings = 0

    def graph(self, first_worker: int, first_serial: int) -> TaskGraph:
        """The step graph dispatched from ``first_worker`` whose first stage has serial ``first_serial``."""
        entry = self._lowered.get(first_worker)
        if entry is None:
            entry = (first_serial, lower(self.plan, self.num_workers, first_worker, self.sizes,
                                         dataclasses.replace(self.options, first_serial=first_serial)))
            self._lowered[first_worker] = entry
            self.lowerings += 1
        serial, base = entry
        shift = first_serial - serial
        if shift == 0:
            return base
        return dataclasses.replace(base, tasks=tuple(_shifted(t, shift) for t in base.tasks),
                                   next_serial=base.next_serial + shift)


def _shifted(task, shift: int):
    """``task`` as lowered with its stage's serial ``shift`` later (see the module doc)."""
    if task.lane == "compute" or task.kind in ("release", "free_kept"):
        return task
    moved = copy.copy(task)
    step = shift * UPLOAD_STRIDE if task.lane == "upload" else shift
    object.__setattr__(moved, "priority", task.priority + step)
    return moved
