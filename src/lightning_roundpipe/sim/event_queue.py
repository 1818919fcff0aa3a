"""A small discrete-event engine: operations on queues, with dependencies and memory effects.

Schedules (RoundPipe, GPipe, 1F1B, ...) are built as lists of :class:`Op` and run here. The
queues behave like the executor's:

- ``compute`` queues run their operations strictly in the order they were added (a CUDA stream
  or a worker thread), each as soon as its dependencies are done;
- ``upload`` / ``download`` queues are links: among the ready transfers the one with the lowest
  ``priority`` goes first, and transfers are cut into chunks so a more urgent one overtakes a
  long weight prefetch at the next chunk boundary. When the link is not duplex the two queues of
  a worker share one link;
- the ``host`` queue (worker -1) runs ready operations one at a time, lowest ``priority`` first,
  then the one ready first (the host optimizer, fed as gradients arrive).

Memory: an operation can allocate bytes on a worker when it starts and free bytes when it ends;
the engine keeps the running total and its peak per worker. Every operation leaves one
:class:`~lightning_roundpipe.tracing.records.TraceRecord` per uninterrupted run on its queue.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field

from ..tracing.records import TraceRecord

HOST = -1


class SimulationError(RuntimeError):
    """The schedule cannot finish (a dependency cycle or an out-of-order queue)."""


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
        return self.queue in ("upload", "download")

    def describe(self) -> str:
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
    """Collects :class:`Op` s with :meth:`add` and runs them with :meth:`run`."""

    def __init__(self, link: LinkSpec) -> None:
        self.link = link
        self.ops: list[Op] = []
        self._order: dict[int, int] = {}
        self.peak_bytes: dict[int, int] = defaultdict(int)
        self.records: list[TraceRecord] = []

    def add(self, op: Op) -> Op:
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
        """Run every op once; fills ``start``/``end``, :attr:`records` and :attr:`peak_bytes`."""
        order = self._order
        waiting = {id(op): 0 for op in self.ops}
        dependents: dict[int, list[Op]] = defaultdict(list)
        for op in self.ops:
            for dep in op.deps:
                if id(dep) not in order:
                    raise SimulationError(f"{op.describe()} depends on {dep.describe()}, which was never added")
                waiting[id(op)] += 1
                dependents[id(dep)].append(op)

        servers: dict[tuple[int, str], object] = {}
        for op in self.ops:
            key = self._server_key(op)
            if key not in servers:
                servers[key] = _InOrderServer() if op.queue == "compute" else _ReadyServer()
            server = servers[key]
            if isinstance(server, _InOrderServer):
                server.ops.append(op)

        remaining: dict[int, int] = {id(op): op.bytes for op in self.ops if op.is_transfer}
        started: set[int] = set()
        is_ready: set[int] = set()
        memory: dict[int, int] = defaultdict(int)
        events: list[tuple[float, int, int, Op, int, float]] = []  # (time, seq, kind, op, chunk bytes, chunk start)
        seq = 0
        now = 0.0
        done = 0
        touched: set[tuple[int, str]] = set()

        def make_ready(op: Op) -> None:
            is_ready.add(id(op))
            key = self._server_key(op)
            server = servers[key]
            if isinstance(server, _ReadyServer):
                # Links serve equal priorities in the order the work was issued; the host serves
                # them in the order they became ready (a FIFO of arrived gradients).
                heapq.heappush(server.ready, (op.priority, now if op.queue == "host" else 0.0, order[id(op)], op))
            touched.add(key)

        def begin(op: Op) -> None:
            if id(op) not in started:
                started.add(id(op))
                op.start = now
                for worker, nbytes in op.alloc:
                    memory[worker] += nbytes
                    if memory[worker] > self.peak_bytes[worker]:
                        self.peak_bytes[worker] = memory[worker]

        # Transfer records are merged per op while they run back to back; keep one "open" record
        # per op instead of relying on list order, since many queues interleave.
        open_record: dict[int, int] = {}

        def record_transfer(op: Op, start: float, end: float, nbytes: int) -> None:
            if nbytes == 0 and end == start:
                return  # an empty transfer that only carries a dependency
            idx = open_record.get(id(op))
            if idx is not None and self.records[idx].end == start:
                r = self.records[idx]
                self.records[idx] = TraceRecord(r.worker, r.queue, r.kind, r.stage, r.microbatch,
                                                r.bytes + nbytes, r.start, end, r.step)
            else:
                open_record[id(op)] = len(self.records)
                self.records.append(TraceRecord(op.worker, op.queue, op.kind, op.stage, op.microbatch,
                                                nbytes, start, end, op.step))

        def try_start(key: tuple[int, str]) -> None:
            nonlocal seq
            server = servers[key]
            if server.busy:
                return
            if isinstance(server, _InOrderServer):
                if server.next >= len(server.ops):
                    return
                op = server.ops[server.next]
                if id(op) not in is_ready:
                    return
                server.next += 1
                server.busy = True
                begin(op)
                seq += 1
                heapq.heappush(events, (now + op.seconds, seq, 0, op, 0, now))
                return
            if not server.ready:
                return
            op = heapq.heappop(server.ready)[-1]
            server.busy = True
            first = id(op) not in started
            begin(op)
            seq += 1
            if op.is_transfer:
                nbytes = min(remaining[id(op)], self.link.chunk_bytes) if remaining[id(op)] > 0 else 0
                heapq.heappush(events, (now + self._chunk_seconds(op, nbytes, first), seq, 1, op, nbytes, now))
            else:
                heapq.heappush(events, (now + op.seconds, seq, 0, op, 0, now))

        def finish(op: Op) -> None:
            nonlocal done
            op.end = now
            done += 1
            for worker, nbytes in op.free:
                memory[worker] -= nbytes
            for nxt in dependents[id(op)]:
                waiting[id(nxt)] -= 1
                if waiting[id(nxt)] == 0:
                    make_ready(nxt)

        for op in self.ops:
            if waiting[id(op)] == 0:
                make_ready(op)
        for key in list(touched):
            try_start(key)
        touched.clear()

        while events:
            now = events[0][0]
            # Handle every event at this instant before starting anything, so memory freed at
            # time t is counted as free for work that starts at t.
            while events and events[0][0] == now:
                _, _, kind, op, nbytes, chunk_start = heapq.heappop(events)
                key = self._server_key(op)
                server = servers[key]
                server.busy = False
                touched.add(key)
                if kind == 0:  # compute or host work done
                    self.records.append(TraceRecord(op.worker, op.queue, op.kind, op.stage, op.microbatch,
                                                    0, op.start, now, op.step))
                    finish(op)
                else:
                    remaining[id(op)] -= nbytes
                    record_transfer(op, chunk_start, now, nbytes)
                    if remaining[id(op)] > 0:
                        heapq.heappush(server.ready, (op.priority, 0.0, order[id(op)], op))
                    else:
                        finish(op)
            for key in sorted(touched, key=lambda k: (k[0], k[1])):
                try_start(key)
            touched.clear()

        if done != len(self.ops):
            stuck = [op for op in self.ops if math.isnan(op.end)]
            names = "; ".join(op.describe() for op in stuck[:5])
            raise SimulationError(f"{len(stuck)} of {len(self.ops)} operations never ran (a dependency cycle or a "
                                  f"queue order that contradicts the dependencies); first: {names}")
