"""A small discrete-event engine: operations on queues, with dependencies and memory effects.

Schedules (RoundPipe, GPipe, 1F1B, ...) are built as lists of ``Op`` and run here on queues that
behave like the executor's: ``compute`` in order, ``upload`` / ``download`` links lowest
``priority`` first in chunks, and a ``host`` queue for the host optimizer. Operations may
allocate and free bytes on a worker (running total and peak kept), and each leaves one
``TraceRecord`` per run on its queue. Details: docs/design.md, design notes, ``sim/event_queue.py``.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field

from ..errors import SimulationError
from ..tracing.records import TraceRecord

HOST = -1


@dataclass(eq=False)
class Op:
    """One unit of work on one queue of one worker."""

    worker: int
    queue: str  # "upload", "compute", "download" or "host"
    kind: str
    stage: str = ""
    microbatch: int = -1
    step: int = 0
    seconds: float = 0.0  # compute and host work
    bytes: int = 0  # transfers
    priority: int = 0  # transfer and host queues: lower goes first among ready ops
    deps: list["Op"] = field(default_factory=list)
    alloc: list[tuple[int, int]] = field(default_factory=list)  # (worker, bytes) taken at start
    free: list[tuple[int, int]] = field(default_factory=list)  # (worker, bytes) given back at end
    # Filled in by the engine.
    start: float = math.nan
    end: float = math.nan

    @property
    def is_transfer(self) -> bool:
        """Whether the op runs on a transfer queue."""
        return self.queue in ("upload", "download")

    def describe(self) -> str:
        """The op in words, for error messages."""
        mb = f" mb{self.microbatch}" if self.microbatch >= 0 else ""
        return f"{self.kind} {self.stage}{mb} step {self.step} on worker {self.worker} {self.queue}"


@dataclass
class LinkSpec:
    """Speed of every worker's host link."""

    bytes_per_s: float
    latency_s: float = 0.0
    duplex: bool = True
    chunk_bytes: int = 32 * 2**20


class _InOrderServer:
    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.next = 0
        self.busy = False


class _ReadyServer:
    """Serves ready ops by (priority, order); transfers one chunk at a time."""

    def __init__(self) -> None:
        self.ready: list[tuple[int, float, int, Op]] = []  # (priority, ready time or 0, order, op)
        self.busy = False


class EventSimulator:
    """Collects ``Op`` s with ``add`` and runs them with ``run``."""

    def __init__(self, link: LinkSpec) -> None:
        self.link = link
        self.ops: list[Op] = []
        self._order: dict[int, int] = {}
        self.peak_bytes: dict[int, int] = defaultdict(int)
        self.records: list[TraceRecord] = []

    def add(self, op: Op) -> Op:
        """Add an op (in submission order) and return it."""
        self._order[id(op)] = len(self.ops)
        self.ops.append(op)
        return op

    # ------------------------------------------------------------------ helpers
    def _server_key(self, op: Op) -> tuple[int, str]:
        if op.is_transfer and not self.link.duplex:
            return (op.worker, "link")
        return (op.worker, op.queue)

    def _chunk_seconds(self, op: Op, nbytes: int, first: bool) -> float:
        bw = self.link.bytes_per_s
        t = nbytes / bw if math.isfinite(bw) else 0.0
        return t + (self.link.latency_s if first else 0.0)

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        """Run every op once; fills ``start``/``end``, ``records`` and ``peak_bytes``."""
        _Run(self).execute()


class _Run:
    """One run of an ``EventSimulator``'s ops: the event loop and its bookkeeping."""

    def __init__(self, sim: EventSimulator) -> None:
        self.sim, self.link, self.order = sim, sim.link, sim._order
        self.waiting = {id(op): 0 for op in sim.ops}
        self.dependents: dict[int, list[Op]] = defaultdict(list)
        for op in sim.ops:
            for dep in op.deps:
                if id(dep) not in self.order:
                    raise SimulationError(f"{op.describe()} depends on {dep.describe()}, which was never added")
                self.waiting[id(op)] += 1
                self.dependents[id(dep)].append(op)
        self.servers: dict[tuple[int, str], object] = {}
        for op in sim.ops:
            key = sim._server_key(op)
            if key not in self.servers:
                self.servers[key] = _InOrderServer() if op.queue == "compute" else _ReadyServer()
            server = self.servers[key]
            if isinstance(server, _InOrderServer):
                server.ops.append(op)
        self.remaining: dict[int, int] = {id(op): op.bytes for op in sim.ops if op.is_transfer}
        self.started: set[int] = set()
        self.is_ready: set[int] = set()
        self.memory: dict[int, int] = defaultdict(int)
        self.events: list[tuple[float, int, int, Op, int, float]] = []  # (time, seq, kind, op, chunk bytes, chunk start)
        self.seq = 0
        self.now = 0.0
        self.done = 0
        self.touched: set[tuple[int, str]] = set()
        # Transfer records are merged per op while they run back to back; keep one "open" record
        # per op instead of relying on list order, since many queues interleave.
        self.open_record: dict[int, int] = {}

    def make_ready(self, op: Op) -> None:
        self.is_ready.add(id(op))
        key = self.sim._server_key(op)
        server = self.servers[key]
        if isinstance(server, _ReadyServer):
            # Links serve equal priorities in the order the work was issued; the host serves
            # them in the order they became ready (a FIFO of arrived gradients).
            heapq.heappush(server.ready, (op.priority, self.now if op.queue == "host" else 0.0, self.order[id(op)], op))
        self.touched.add(key)

    def begin(self, op: Op) -> None:
        if id(op) not in self.started:
            self.started.add(id(op))
            op.start = self.now
            peak = self.sim.peak_bytes
            for worker, nbytes in op.alloc:
                self.memory[worker] += nbytes
                if self.memory[worker] > peak[worker]:
                    peak[worker] = self.memory[worker]

    def record_transfer(self, op: Op, start: float, end: float, nbytes: int) -> None:
        if nbytes == 0 and end == start:
            return  # an empty transfer that only carries a dependency
        records = self.sim.records
        idx = self.open_record.get(id(op))
        if idx is not None and records[idx].end == start:
            r = records[idx]
            records[idx] = TraceRecord(r.worker, r.queue, r.kind, r.stage, r.microbatch, r.bytes + nbytes, r.start, end,
                                       r.step)
        else:
            self.open_record[id(op)] = len(records)
            records.append(TraceRecord(op.worker, op.queue, op.kind, op.stage, op.microbatch, nbytes, start, end,
                                       op.step))

    def push(self, at: float, kind: int, op: Op, nbytes: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, op, nbytes, self.now))

    def try_start(self, key: tuple[int, str]) -> None:
        server = self.servers[key]
        if server.busy:
            return
        if isinstance(server, _InOrderServer):
            if server.next >= len(server.ops):
                return
            op = server.ops[server.next]
            if id(op) not in self.is_ready:
                return
            server.next += 1
            server.busy = True
            self.begin(op)
            self.push(self.now + op.seconds, 0, op, 0)
            return
        if not server.ready:
            return
        op = heapq.heappop(server.ready)[-1]
        server.busy = True
        first = id(op) not in self.started
        self.begin(op)
        if op.is_transfer:
            left = self.remaining[id(op)]
            nbytes = min(left, self.link.chunk_bytes) if left > 0 else 0
            self.push(self.now + self.sim._chunk_seconds(op, nbytes, first), 1, op, nbytes)
        else:
            self.push(self.now + op.seconds, 0, op, 0)

    def finish(self, op: Op) -> None:
        op.end = self.now
        self.done += 1
        for worker, nbytes in op.free:
            self.memory[worker] -= nbytes
        for nxt in self.dependents[id(op)]:
            self.waiting[id(nxt)] -= 1
            if self.waiting[id(nxt)] == 0:
                self.make_ready(nxt)

    def start_touched(self, ordered: bool) -> None:
        for key in (sorted(self.touched, key=lambda k: (k[0], k[1])) if ordered else list(self.touched)):
            self.try_start(key)
        self.touched.clear()

    def handle(self, kind: int, op: Op, nbytes: int, chunk_start: float) -> None:
        key = self.sim._server_key(op)
        server = self.servers[key]
        server.busy = False
        self.touched.add(key)
        if kind == 0:  # compute or host work done
            self.sim.records.append(TraceRecord(op.worker, op.queue, op.kind, op.stage, op.microbatch, 0, op.start,
                                                self.now, op.step))
            self.finish(op)
            return
        self.remaining[id(op)] -= nbytes
        self.record_transfer(op, chunk_start, self.now, nbytes)
        if self.remaining[id(op)] > 0:
            heapq.heappush(server.ready, (op.priority, 0.0, self.order[id(op)], op))
        else:
            self.finish(op)

    def execute(self) -> None:
        ops, events = self.sim.ops, self.events
        for op in ops:
            if self.waiting[id(op)] == 0:
                self.make_ready(op)
        self.start_touched(ordered=False)
        while events:
            self.now = events[0][0]
            # Handle every event at this instant before starting anything, so memory freed at
            # time t is counted as free for work that starts at t.
            while events and events[0][0] == self.now:
                _, _, kind, op, nbytes, chunk_start = heapq.heappop(events)
                self.handle(kind, op, nbytes, chunk_start)
            self.start_touched(ordered=True)
        if self.done != len(ops):
            stuck = [op for op in ops if math.isnan(op.end)]
            names = "; ".join(op.describe() for op in stuck[:5])
            raise SimulationError(f"{len(stuck)} of {len(ops)} operations never ran (a dependency cycle or a "
                                  f"queue order that contradicts the dependencies); first: {names}")
