"""What the lanes report: counts of what they did (``LaneCounters``) and, when a wait times out,
which task it is really stuck on (``blocker``) and what every lane runs and waits for."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ..schedule.graph_task import LANES

if TYPE_CHECKING:
    from .completions import Completion, Lane

# ``WorkerPool`` (pool.py) is named only in annotations: pool.py imports this module.


@dataclass(frozen=True)
class LaneCounters:
    """What the pool's lanes did since the pool started (or ``reset_lane_counters``), summed over
    every lane: read with ``WorkerPool.lane_counters()``; subtract two readings for an interval.

    ``wakeups``: a lane's thread returned from its wait (woken by a task it can now run, by
    shutdown, or by the deadline of its oldest waiting task). ``looks``: a lane looked for a task
    to run (once per wake-up and once after each task). ``tasks_examined``: pending tasks those
    looks examined (one at most per look: lanes index their tasks by readiness instead of scanning
    the pending list). ``dependency_wakes``: dependencies that became ready and told their task
    (set, or their device work finished). ``device_notifications``: of those, device events whose
    completion the stream driver reported (no polling). ``tasks_run``: tasks the lanes ran (or
    failed with a dependency's error). ``bookkeeping_s``: host seconds spent in this
    bookkeeping under the pool lock (submits, notifications, looks), on whatever thread.
    """

    wakeups: int = 0
    looks: int = 0
    tasks_examined: int = 0
    dependency_wakes: int = 0
    device_notifications: int = 0
    tasks_run: int = 0
    bookkeeping_s: float = 0.0

    def __sub__(self, earlier: "LaneCounters") -> "LaneCounters":
        return LaneCounters(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))


class LaneTally:
    """The mutable counts behind ``LaneCounters``, changed only under the pool lock."""

    __slots__ = tuple(f.name for f in fields(LaneCounters))

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        """Every count back to zero."""
        for f in fields(LaneCounters):
            setattr(self, f.name, f.default)

    def snapshot(self) -> LaneCounters:
        """The counts now, frozen."""
        return LaneCounters(*(getattr(self, name) for name in self.__slots__))


def describe_lanes(pool: WorkerPool, waited: Completion | None = None) -> str:
    """What is stuck (when ``waited`` is given), then what each lane runs and holds (call with the pool lock held)."""
    lines = []
    if waited is not None:
        lines.append(f"stuck: {blocker(pool, waited)}")
    lines.append("lanes:")
    for lane in pool.lanes():
        for text in lane.describe_pending()[:4]:
            lines.append(f"  worker {lane.worker.index} {lane.queue}: {text}")
    if len(lines) == (2 if waited is not None else 1):
        lines.append("  every lane is idle")
    return "\n".join(lines)


def blocker(pool: WorkerPool, waited: Completion) -> str:
    """The task a wait for ``waited`` really waits on: follow unfinished dependencies (and, in an
    in-order lane, the task ahead) down to a running task or an event that nothing will set."""
    seen = set()
    c = waited
    while id(c) not in seen:
        seen.add(id(c))
        if c.is_set() and (c.device_event is None or c.device_event.query()):
            return f"[{c.label}] is done"
        if c.started:
            since = time.monotonic() - c.started
            state = "running" if not c.is_set() else "issued, its device work unfinished"
            return f"[{c.label}] {state} for {since:.1f}s"
        dep = next((d for d in c.deps if not d.is_set() or (d.device_event is not None and not d.device_event.query())),
                   None)
        if dep is not None:
            c = dep
            continue
        lane = _lane_of(pool, c)
        if lane is None:
            return f"[{c.label}] (set by the host, not by a worker task) was never set"
        if lane.running is not None:
            c = lane.running.done
            continue
        ahead = lane.first_waiting()
        if ahead is not None and ahead.done is not c and lane.strict_order:
            c = ahead.done
            continue
        return f"[{c.label}] is ready and waits for its lane"
    return f"[{c.label}] (dependency cycle)"


def _lane_of(pool: WorkerPool, c: Completion) -> Lane | None:
    lab = c.label
    if 0 <= lab.worker < len(pool.workers) and lab.queue in LANES:
        return pool.workers[lab.worker].lanes[lab.queue]
    return None
