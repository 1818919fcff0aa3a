"""What the simulated host does between forward-backward calls: accumulate, update, submit.

- ``CallAccumulator``: gradient accumulation over ``accumulation`` calls per optimizer
  step, and which optimizer updates the next call's weight uploads wait for. Synchronous
  (default): the update of the previous optimizer step. One-step-stale (``stale``): the one
  before it, so step k + 1 computes with the weights of step k - 1 while step k's update runs
  on the host (the reference RoundPipe's overlap; not this project's exact optimizer).
- ``submission``: the host's time to submit each task (``HardwareProfile.dispatch_s``):
  one Python process submits every task of every worker, one after another, so a task cannot
  start before the host has submitted it and all tasks before it.
"""

from __future__ import annotations

from typing import Callable

from ..cost.graph_timing import LaneTimer, LaneWork
from ..schedule.graph_task import MAIN_LANE
from ..tracing.records import HOST_WORKER

Updates = dict[int, list[LaneWork]]  # layer -> the optimizer ops its next upload waits for


class CallAccumulator:
    """Gradients of the calls of one optimizer step, and the updates later uploads wait for.

    ``optimizer(wgrads, call)`` adds the host optimizer's updates for ``wgrads`` (layer -> the
    gradient downloads of that layer, all calls of the step) and returns, per layer, what the
    next upload of that layer must wait for.
    """

    def __init__(self, optimizer: Callable[[dict[int, list[LaneWork]], int], Updates], accumulation: int = 1,
                 stale: bool = False) -> None:
        if accumulation < 1:
            raise ValueError(f"accumulation must be at least 1, got {accumulation}")
        self.optimizer, self.accumulation, self.stale = optimizer, accumulation, stale
        self.gate: Updates = {}  # what the current call's weight uploads wait for
        self.pending: Updates = {}  # stale: the last update, which the step after next waits for
        self.wgrads: dict[int, list[LaneWork]] = {}
        self.calls = 0

    def add_call(self, wgrads: list[tuple[int, LaneWork]], call: int) -> None:
        """Record one call's gradient downloads (``(layer, op)``); at a step's last call, update."""
        for layer, op in wgrads:
            self.wgrads.setdefault(layer, []).append(op)
        self.calls += 1
        if self.calls % self.accumulation:
            return
        updates = self.optimizer(self.wgrads, call)
        self.wgrads = {}
        if self.stale:
            self.gate, self.pending = self.pending, updates
        else:
            self.gate = updates


def submission(sim: LaneTimer, previous: LaneWork | None, gate: list[LaneWork], seconds: float, task, step: int) -> LaneWork:
    """The host submitting ``task``: after the previous submission and the host barrier ``gate``."""
    deps = ([previous] if previous is not None else []) + list(gate)
    return sim.add(LaneWork(HOST_WORKER, MAIN_LANE, "submit", task.stage, task.microbatch, step, seconds=seconds, deps=deps))
