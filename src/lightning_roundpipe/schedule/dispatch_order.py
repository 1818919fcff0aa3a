"""The schedule as an object: which worker runs each dispatched stage, and where the next call starts.

A ``Schedule`` answers two questions, and every reader asks it instead of re-deriving the
rule: the lowering (which worker each stage's tasks go to), the history's cursor across calls
and steps (``WorkerHistory``), the timing model and the search (which worker a
stage waits for), the memory model (which stages share a worker over steps), the plan report,
the engine and the simulator.

- ``dispatch(plan, num_workers, cursor, fused)``: the stages of one call in dispatch order
  (forward stages in order, then backward stages last layers first; ``dispatch``),
  each with its worker, the first one going to worker ``cursor``;
- ``cursor_after(cursor, dispatched, num_workers)``: the cursor of the next call, after a call
  dispatched ``dispatched`` stages from ``cursor``.

Schedules are named (``SCHEDULES``); ``EngineOptions.schedule`` and ``RuntimeOptions.schedule``
select one by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .plan import Plan, PlanError, Task, dispatch


class Schedule(Protocol):
    """A dispatch order of a call's stages over the workers, and the cursor it carries across calls."""

    name: str

    def dispatch(self, plan: Plan, num_workers: int, cursor: int = 0, fused: bool | None = None) -> list[Task]:
        """One call's dispatched stages, in order, each with its worker (``fused`` as in ``dispatch``)."""

    def cursor_after(self, cursor: int, dispatched: int, num_workers: int) -> int:
        """Where the next call's dispatch starts, after ``dispatched`` stages dispatched from ``cursor``."""


@dataclass(frozen=True)
class RoundRobin:
    """Each stage to the worker after the previous one's; the next call goes on from where this one ended."""

    name: str = "round_robin"

    def dispatch(self, plan: Plan, num_workers: int, cursor: int = 0, fused: bool | None = None) -> list[Task]:
        """The plan's tasks, each stage to the worker after the previous stage's, from ``cursor``."""
        return dispatch(plan, num_workers, cursor, fused)

    def cursor_after(self, cursor: int, dispatched: int, num_workers: int) -> int:
        """The worker the next call starts from: after the last one this call used."""
        return (cursor + dispatched) % num_workers


@dataclass(frozen=True)
class Sticky(RoundRobin):
    """Round-robin within a call, but every call starts on worker 0: a stage runs on the same worker in
    every call and step (its weights are uploaded there again each time; a backend that kept them
    would find them in place). The same as round-robin when the stages of a call fill the workers evenly."""

    name: str = "sticky"

    def dispatch(self, plan: Plan, num_workers: int, cursor: int = 0, fused: bool | None = None) -> list[Task]:
        """The plan's tasks dispatched round-robin from worker 0 (``cursor`` ignored)."""
        return dispatch(plan, num_workers, 0, fused)

    def cursor_after(self, cursor: int, dispatched: int, num_workers: int) -> int:
        """Always worker 0: every call starts there."""
        return 0


ROUND_ROBIN = RoundRobin()
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (ROUND_ROBIN, Sticky())}


def schedule_named(name: str) -> Schedule:
    """The schedule called ``name``; a ``PlanError`` listing the names otherwise."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise PlanError(f"unknown schedule {name!r}; the schedules are {sorted(SCHEDULES)}") from None
