"""The one timing model: what each task of a lowered step costs, and how a worker's lanes serve it.

``compute_seconds`` and ``link_seconds`` price a task; ``task_work`` turns a ``GraphTask`` into the
``LaneWork`` it puts on its lane (seconds, bytes, memory taken and given back); ``LaneTimer`` runs
lane work by the lanes' rules (``schedule/graph_task.py``: compute in submission order, transfers
lowest priority first in chunks, one shared link when not duplex, the host lane). The simulator,
the bound baselines and the emulated backend's device times all call these; the planner's search
uses ``planning/predictor.py``, a closed form that tests/cost/test_graph_timing.py proves equal to
this model on random lowered graphs with free transfers. Rules: docs/design.md, ``cost/graph_timing.py``.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field

from ..errors import SimulationError
from ..schedule.graph_task import HOST_LANE, IN_ORDER_LANES, TRANSFER_LANES, UPLOAD, GraphTask, TaskKind
from ..tracing.records import TraceRecord
from .memory import layer_grain_graph
from .view import CostView


def link_seconds(nbytes: float, bytes_per_s: float, latency_s: float = 0.0) -> float:
    """One copy of ``nbytes`` over a host link of ``bytes_per_s`` (infinite: free) after ``latency_s``."""
    return (nbytes / bytes_per_s if math.isfinite(bytes_per_s) else 0.0) + latency_s


def compute_seconds(view: CostView, kind: TaskKind, start: int, end: int, grain: str = "",
                    inputs_kept: bool = False) -> float:
    """Device seconds of a compute task of ``kind`` over layers ``[start, end)``.

    Backward recomputes the stage (its last layer stopping early where the profile says so);
    fused keeps its graph. ``grain="layer"``: every layer but the last stops its recompute
    early, and, unless the forward kept the layer inputs (``inputs_kept``), a pass without grad
    over those layers first keeps them.
    """
    if kind == TaskKind.FORWARD:
        seconds = view.forward_s(start, end)
    elif kind == TaskKind.FUSED:
        seconds = view.fused_s(start, end)
    else:
        seconds = view.backward_with_recompute_s(start, end)
    if grain == "layer":
        seconds -= view.early_stop_s(start, end - 1)
        if not inputs_kept:
            seconds += view.forward_s(start, end - 1)
    return seconds


@dataclass(eq=False)
class LaneWork:
    """Work that holds one lane of one worker for a while: a graph task as timed, a bound schedule's
    step or the host's work; not a task the engine runs (that is ``GraphTask``)."""

    worker: int
    queue: str  # a lane (``LANES``), ``HOST_LANE`` or a host thread: ``IN_ORDER_LANES`` in order, others by priority
    kind: str
    stage: str = ""
    microbatch: int = -1
    step: int = 0
    seconds: float = 0.0  # compute and host work
    bytes: int = 0  # transfers
    priority: int = 0  # transfer and host queues: lower goes first among ready ops
    deps: list["LaneWork"] = field(default_factory=list)
    alloc: list[tuple[int, int]] = field(default_factory=list)  # (worker, bytes) taken at start
    free: list[tuple[int, int]] = field(default_factory=list)  # (worker, bytes) given back at end
    # Filled in by the timer.
    start: float = math.nan
    end: float = math.nan

    @property
    def is_transfer(self) -> bool:
        """Whether the work runs on a transfer lane."""
        return self.queue in TRANSFER_LANES

    def describe(self) -> str:
        """The work in words, for error messages."""
        mb = f" mb{self.microbatch}" if self.microbatch >= 0 else ""
        return f"{self.kind} {self.stage}{mb} step {self.step} on worker {self.worker} {self.queue}"


@dataclass
class LinkSpec:
    """Speed of every worker's host link."""

    bytes_per_s: float
    latency_s: float = 0.0
    duplex: bool = True
    chunk_bytes: int = 32 * 2**20


class CostSizes:
    """The timing model's ``Sizes`` (``schedule/graph_task.py``): per-layer transfers of a cost view."""

    def __init__(self, view: CostView) -> None:
        self.view = view

    def weight_chunks(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """One upload chunk per layer of ``[start, end)``, with its weight bytes."""
        return [(layer, layer + 1, self.view.layers[layer].weight_bytes) for layer in range(start, end)]

    def grad_chunks(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """One gradient download per trainable layer of ``[start, end)``, last layer first."""
        # Last layers first, as backward produces them; frozen layers send nothing.
        return [(layer, layer + 1, self.view.layers[layer].grad_download_bytes) for layer in reversed(range(start, end))
                if self.view.layers[layer].grad_bytes > 0]

    def boundary_bytes(self, boundary: int) -> int:
        """Bytes of the activation entering layer ``boundary``."""
        return self.view.in_bytes(boundary)


def task_work(t: GraphTask, view: CostView, step: int, deps: list[LaneWork], *, inputs=(), outputs=(),
              first: bool = True, last: bool = True, inputs_kept: bool = False) -> LaneWork:
    """The work graph task ``t`` puts on its lane (not a release: that takes no time), after ``deps``.

    Transfers move ``t.bytes``; a weights upload holds the weights as the worker keeps them, a
    gradient download frees the worker's fp32 gradients. A compute takes ``compute_seconds`` and
    holds its working graph and outputs; ``inputs``/``outputs``: the graph tasks it reads from and
    writes to; ``first``/``last``: its worker's first (takes the gradients) and last (frees the
    weights) compute of the stage; ``inputs_kept``: see ``compute_seconds``.
    """
    w, a, b = t.worker, t.start, t.end
    if t.lane in TRANSFER_LANES:
        if t.lane == UPLOAD:
            held = view.weights(*t.layers) if t.kind == TaskKind.WEIGHTS else t.bytes
            return LaneWork(w, t.lane, t.kind, t.stage, t.microbatch, step, bytes=t.bytes, priority=t.priority,
                            deps=deps, alloc=[(w, held)])
        free = [(w, view.grads(*t.layers))] if t.kind == TaskKind.WGRAD else [] if t.kind == TaskKind.LOSS else [(w, t.bytes)]
        return LaneWork(w, t.lane, t.kind, t.stage, t.microbatch, step, bytes=t.bytes, priority=t.priority,
                        deps=deps, free=free)
    transient = layer_grain_graph(view, a, b) if t.grain == "layer" else view.stage_graph(t.kind, a, b)
    grads_total = view.grads(a, b) if t.kind != TaskKind.FORWARD else 0
    out_total = sum(o.bytes for o in outputs)
    in_total = sum(i.bytes for i in inputs if i.kind in (TaskKind.ACT_IN, TaskKind.GRAD_IN))
    alloc = [(w, transient + out_total)] + ([(w, grads_total)] if first and grads_total else [])
    free = [(w, transient + in_total)] + ([(w, view.weights(a, b))] if last else [])
    seconds = compute_seconds(view, t.kind, a, b, t.grain, inputs_kept)
    return LaneWork(w, t.lane, t.kind, t.stage, t.microbatch, step, seconds=seconds, deps=deps, alloc=alloc, free=free)


class _InOrderServer:
    def __init__(self) -> None:
        self.ops: list[LaneWork] = []
        self.next = 0
        self.busy = False


class _ReadyServer:
    """Serves ready ops by (priority, order); transfers one chunk at a time."""

    def __init__(self) -> None:
        self.ready: list[tuple[int, float, int, LaneWork]] = []  # (priority, ready time or 0, order, op)
        self.busy = False


class LaneTimer:
    """Collects ``LaneWork`` s with ``add`` and runs them with ``run``."""

    def __init__(self, link: LinkSpec) -> None:
        self.link = link
        self.ops: list[LaneWork] = []
        self._order: dict[int, int] = {}
        self.peak_bytes: dict[int, int] = defaultdict(int)
        self.records: list[TraceRecord] = []

    def add(self, op: LaneWork) -> LaneWork:
        """Add an op (in submission order) and return it."""
        self._order[id(op)] = len(self.ops)
        self.ops.append(op)
        return op

    def _server_key(self, op: LaneWork) -> tuple[int, str]:
        if op.is_transfer and not self.link.duplex:
            return (op.worker, "link")
        return (op.worker, op.queue)

    def run(self) -> None:
        """Run every op once; fills ``start``/``end``, ``records`` and ``peak_bytes``."""
        _Run(self).execute()


class _Run:
    """One run of a ``LaneTimer``'s work: the event loop and its bookkeeping."""

    def __init__(self, sim: LaneTimer) -> None:
        self.sim, self.link, self.order = sim, sim.link, sim._order
        self.waiting = {id(op): 0 for op in sim.ops}
        self.dependents: dict[int, list[LaneWork]] = defaultdict(list)
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
                self.servers[key] = _InOrderServer() if op.queue in IN_ORDER_LANES else _ReadyServer()
            server = self.servers[key]
            if isinstance(server, _InOrderServer):
                server.ops.append(op)
        self.remaining: dict[int, int] = {id(op): op.bytes for op in sim.ops if op.is_transfer}
        self.started: set[int] = set()
        self.is_ready: set[int] = set()
        self.memory: dict[int, int] = defaultdict(int)
        self.events: list[tuple[float, int, int, LaneWork, int, float]] = []  # (time, seq, kind, op, chunk bytes, chunk start)
        self.seq = 0
        self.now = 0.0
        self.done = 0
        self.touched: set[tuple[int, str]] = set()
        # Transfer records are merged per op while they run back to back; keep one "open" record
        # per op instead of relying on list order, since many queues interleave.
        self.open_record: dict[int, int] = {}

    def make_ready(self, op: LaneWork) -> None:
        self.is_ready.add(id(op))
        key = self.sim._server_key(op)
        server = self.servers[key]
        if isinstance(server, _ReadyServer):
            # Links serve equal priorities in the order the work was issued; the host serves
            # them in the order they became ready (a FIFO of arrived gradients).
            heapq.heappush(server.ready, (op.priority, self.now if op.queue == HOST_LANE else 0.0, self.order[id(op)], op))
        self.touched.add(key)

    def begin(self, op: LaneWork) -> None:
        if id(op) not in self.started:
            self.started.add(id(op))
            op.start = self.now
            peak = self.sim.peak_bytes
            for worker, nbytes in op.alloc:
                self.memory[worker] += nbytes
                if self.memory[worker] > peak[worker]:
                    peak[worker] = self.memory[worker]

    def record_transfer(self, op: LaneWork, start: float, end: float, nbytes: int) -> None:
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

    def push(self, at: float, kind: int, op: LaneWork, nbytes: int) -> None:
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
            seconds = link_seconds(nbytes, self.link.bytes_per_s, self.link.latency_s if first else 0.0)
            self.push(self.now + seconds, 1, op, nbytes)
        else:
            self.push(self.now + op.seconds, 0, op, 0)

    def finish(self, op: LaneWork) -> None:
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

    def handle(self, kind: int, op: LaneWork, nbytes: int, chunk_start: float) -> None:
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
