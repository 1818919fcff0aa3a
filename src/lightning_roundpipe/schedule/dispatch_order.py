"""The schedule as an object: which worker runs each dispatched stage, and where the next call starts.

A ``Schedule`` answers two questions for every reader (the lowering, the history's cursor, the
timing model, the memory model, the plan report, the engine and the simulator), so none
re-derives the rule: ``dispatch(plan, num_workers, cursor, fused)`` gives the stages of one call
in dispatch order with their workers, and ``cursor_after`` the next call's cursor. Schedules are
named (``SCHEDULES``) and selected with the ``schedule`` option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .plan import DispatchedStage, Plan, PlanError, dispatch


class Schedule(Protocol):
    """A dispatch order of a call's stages over the workers, and the cursor it carries across calls."""

    name: str

    def dispatch(self, plan: Plan, num_workers: int, cursor: int = 0, fused: bool | None = None) -> list[DispatchedStage]:
        """One call's dispatched stages, in order, each with its worker (``fused`` as in ``dispatch``)."""

    def cursor_after(self, cursor: int, dispatched: int, num_workers: int) -> int:
        """Where the next call's dispatch starts, after ``dispatched`` stages dispatched from ``cursor``."""


@dataclass(frozen=True)
class RoundRobin:
    """Each stage to the worker after the previous one's; the next call goes on from where this one ended."""

    name: str = "round_robin"

    def dispatch(self, plan: Plan, num_workers: int, cursor: int = 0, fused: bool | None = None) -> list[DispatchedStage]:
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

    def dispatch(self, plan: Plan, num_workers: int, cursor: int = 0, fused: bool | None = None) -> list[DispatchedStage]:
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
