"""Per-task timeline records, written by the worker lanes while they run, and what they measure.

One ``TraceRecord`` per task on any queue of any worker. Times are seconds from the
recorder's origin (``time.perf_counter`` on the CPU backend, CUDA events on the CUDA backend).
How well a recorded (or simulated) step overlaps its work is a pure function of its records
(``bubble_fraction``, ``exposed_transfer_seconds``, ``hidden_share``, ``step_metrics``,
``summarize_by_step``); the Chrome trace (``chrome``) and the PNG (``gantt``) read them too.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from ..schedule.graph_task import DOWNLOAD, HOST_LANE, TRANSFER_LANES


HOST_WORKER = -1  # TraceRecord.worker of tasks that run on the host


@dataclass(frozen=True)
class TraceRecord:
    """One task as it ran: worker, queue, kind, stage, microbatch, bytes, start and end."""
    worker: int  # worker index, or -1 for the host (optimizer, gradient accumulation)
    queue: str  # "upload", "compute", "download" or "host"
    kind: str  # e.g. "weights", "act_in", "forward", "backward", "fused", "act_out", "grad_in", "grad_out", "wgrad", "optim"
    stage: str  # stage name such as "F0" or "B3", or "" when not tied to a stage
    microbatch: int  # -1 when the task is not per microbatch
    bytes: int  # bytes moved (transfers) or 0
    start: float  # seconds since the recorder's origin
    end: float
    step: int = 0  # the training step the task belongs to

    @property
    def duration(self) -> float:
        """Seconds the task took."""
        return self.end - self.start

    def as_dict(self) -> dict:
        """The record as a plain dict."""
        return asdict(self)


class TraceRecorder:
    """Thread-safe list of records.

    ``enabled`` asks for a timeline (step metrics, exported traces). Independently, an engine
    that learns task times from the records calls ``keep_task_times``; the lanes record
    whenever ``recording`` is true, and that engine drops a step's records once it has
    read them unless a timeline was asked for.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[TraceRecord] = []
        self.origin = time.perf_counter()
        self.enabled = False
        self.measuring = False
        self.step = 0

    def ask_for_timeline(self, enabled: bool) -> None:
        """Whether a timeline is wanted (``enabled``): the runtime's ``step_metrics`` or ``trace_steps``."""
        self.enabled = enabled

    @property
    def recording(self) -> bool:
        """Whether the lanes add a record per task (a timeline, or task times, is wanted)."""
        return self.enabled or self.measuring

    def keep_task_times(self) -> None:
        """Record every task even without a timeline: the caller reads and drops each step's records."""
        self.measuring = True

    def now(self) -> float:
        """Seconds since the recorder's origin."""
        return time.perf_counter() - self.origin

    def add(self, record: TraceRecord) -> None:
        """Keep a record (thread-safe)."""
        with self._lock:
            self._records.append(record)

    def records(self, step: int | None = None) -> list[TraceRecord]:
        """The records kept, of ``step`` only when given."""
        with self._lock:
            out = list(self._records)
        return out if step is None else [r for r in out if r.step == step]

    def discard_step(self, step: int) -> None:
        """Forget the records of one step (metrics were taken; the timeline keeps only chosen steps)."""
        with self._lock:
            self._records = [r for r in self._records if r.step != step]

    def discard_unkept(self, through: int, kept=()) -> None:
        """Forget the records of every step up to ``through`` that is not in ``kept``: records that
        arrive after their step's metrics were taken (a host-lane optimizer update finishing after
        backward) go at the next step, so a long run holds at most about one step's records."""
        kept = set(kept)
        with self._lock:
            self._records = [r for r in self._records if r.step > through or r.step in kept]

    def __len__(self) -> int:
        """How many records are kept now."""
        with self._lock:
            return len(self._records)

    def discard_before(self, step: int) -> None:
        """Forget the records of every step before ``step`` (calls whose records nobody read)."""
        with self._lock:
            self._records = [r for r in self._records if r.step >= step]


# ---------------------------------------------------------------------------- metrics


Interval = tuple[float, float]


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge intervals into sorted, disjoint ones (touching intervals merge too)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue  # an empty task occupies no time
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(disjoint: Sequence[Interval]) -> float:
    return sum(end - start for start, end in disjoint)


def _overlap_length(disjoint_a: Sequence[Interval], disjoint_b: Sequence[Interval]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(disjoint_a) and j < len(disjoint_b):
        (a0, a1), (b0, b1) = disjoint_a[i], disjoint_b[j]
        total += max(0.0, min(a1, b1) - max(a0, b0))
        # Advance whichever interval ends first; the other may still meet the next one.
        if a1 <= b1:
            i += 1
        else:
            j += 1
    return total


def _by_worker(records: Iterable[TraceRecord], queues: Sequence[str]) -> dict[int, list[Interval]]:
    out: dict[int, list[Interval]] = defaultdict(list)
    for r in records:
        if r.queue in queues:
            out[r.worker].append((r.start, r.end))
    return out


def bubble_fraction(records: Sequence[TraceRecord], num_workers: int | None = None) -> float:
    """Idle share of the workers' compute queues while the pipeline computes.

    The window is from the first compute task's start to the last compute task's end, over all
    workers. With ``busy`` the summed (per-worker union) compute time and ``Q`` the number of
    compute queues, the bubble fraction is ``1 - busy / (Q * window)``. ``Q`` is the number of
    workers that ran at least one compute task, or ``num_workers`` when given (so a worker that
    got no work at all counts as fully idle). Returns 0.0 when there is no compute time.
    """
    per_worker = _by_worker(records, ("compute",))
    if num_workers is not None and num_workers < len(per_worker):
        raise ValueError(
            f"num_workers={num_workers} but compute tasks ran on {len(per_worker)} workers "
            f"({sorted(per_worker)}); pass the pool size or leave num_workers unset"
        )
    if not per_worker:
        return 0.0
    first = min(s for spans in per_worker.values() for s, _ in spans)
    last = max(e for spans in per_worker.values() for _, e in spans)
    window = last - first
    queues = num_workers if num_workers is not None else len(per_worker)
    if window <= 0:
        return 0.0
    busy = sum(_length(_union(spans)) for spans in per_worker.values())
    return 1.0 - busy / (queues * window)


def exposed_transfer_seconds(records: Sequence[TraceRecord]) -> float:
    """Seconds during which a worker moves data while its compute queue is idle, summed over workers.

    Per worker: the union of its upload and download task intervals, minus the union of its
    compute task intervals; the remaining lengths are summed over workers. Transfers that run
    under that worker's own compute are hidden and do not count; host tasks are ignored.
    """
    transfers = _by_worker(records, TRANSFER_LANES)
    computes = _by_worker(records, ("compute",))
    exposed = 0.0
    for worker, spans in transfers.items():
        moving = _union(spans)
        exposed += _length(moving) - _overlap_length(moving, _union(computes.get(worker, [])))
    return exposed


def hidden_share(records: Sequence[TraceRecord], kind: str = "optim") -> float:
    """Share of the host tasks of ``kind`` that runs while some worker computes.

    Precisely: for every record with ``queue == "host"`` and ``kind == kind``, take the length of
    its interval that overlaps the union of all compute intervals of all workers; the result is
    the sum of those overlaps divided by the sum of those host tasks' durations. 1.0 means the
    host work (by default the optimizer step) is fully hidden behind GPU compute, 0.0 means it
    is fully exposed. Returns 0.0 when there are no such tasks or they take no time.
    """
    host = [(r.start, r.end) for r in records if r.queue == HOST_LANE and r.kind == kind]
    total = sum(max(0.0, end - start) for start, end in host)
    if total <= 0:
        return 0.0
    computing = _union(s for spans in _by_worker(records, ("compute",)).values() for s in spans)
    # Each host task separately (not their union), so parallel host threads each count.
    hidden = sum(_overlap_length([(s, e)], computing) for s, e in host if e > s)
    return hidden / total


def step_metrics(records: Sequence[TraceRecord], tokens: int | None, compile_s: float = 0.0) -> dict:
    """The headline numbers of one step (or of any window of records).

    Keys: ``bubble_fraction`` (``bubble_fraction``), ``exposed_transfer_s``
    (``exposed_transfer_seconds``), ``optim_hidden_share`` (``hidden_share`` of the
    ``"optim"`` host tasks), ``step_s`` (first start to last end over all records, less
    ``compile_s``: the seconds compiles took during the step, kept as ``compile_s``),
    ``tokens`` and ``tokens_per_s`` (``tokens / step_s``; ``None`` when ``tokens`` is ``None``,
    0.0 when ``step_s`` is 0).
    """
    span = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    step_s = max(0.0, span - compile_s)
    if tokens is None:
        tokens_per_s = None
    else:
        tokens_per_s = tokens / step_s if step_s > 0 else 0.0
    return {
        "bubble_fraction": bubble_fraction(records),
        "exposed_transfer_s": exposed_transfer_seconds(records),
        "optim_hidden_share": hidden_share(records, "optim"),
        "step_s": step_s,
        "compile_s": compile_s,
        "tokens": tokens,
        "tokens_per_s": tokens_per_s,
    }


def summarize_by_step(
    records: Sequence[TraceRecord], tokens: int | Mapping[int, int] | None = None
) -> dict[int, dict]:
    """``step_metrics`` for each training step, keyed by step number in ascending order.

    ``tokens`` is the token count of every step (an int), per step (a mapping from step to
    count; missing steps get ``None``), or ``None`` to leave throughput out.
    """
    grouped: dict[int, list[TraceRecord]] = defaultdict(list)
    for r in records:
        grouped[r.step].append(r)
    out = {}
    for step in sorted(grouped):
        step_tokens = tokens.get(step) if isinstance(tokens, Mapping) else tokens
        out[step] = step_metrics(grouped[step], step_tokens)
    return out


class HostClock:
    """Measures the host's own work around pipelined training calls, on the trace recorder's clock,
    into ``sink`` (the plan keeper's ``unread_host``, read by its ``observe_host``):

    * between forward and backward: from the last forward output on the host (the last forward
      download in the trace; the call's return when no task was recorded) to the moment the
      output's gradient reaches the pipeline (a gradient hook on the outputs): merging the
      microbatch outputs, the caller's loss on them and its backward;
    * between steps: from the end of one training call's backward to the next training call
      (the training loop, the optimizer's submission, the next batch); an evaluation call in
      between voids that interval.
    """

    def __init__(self, sink: list, clock: Callable[[], float]) -> None:
        self.sink = sink
        self.clock = clock
        self.last_end: float | None = None
        self.pending: dict[int, dict] = {}  # engine step -> times of that call

    def interrupted(self) -> None:
        """An evaluation call ran: the time since the last backward is not the training loop's."""
        self.last_end = None

    def forward_returned(self, run, called: float, out) -> None:
        """Note when a pipelined call returned and how long the host spent outside the pipeline before it."""
        now = self.clock()
        entry = {"called": called, "returned": now, "outside": None if self.last_end is None else called - self.last_end}
        self.pending = {run.step: entry}  # an older call never reached backward: forget it
        if run.fused:
            return
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(lambda grad, entry=entry: self.gradient_arrived(entry))

    def gradient_arrived(self, entry: dict) -> None:
        """An output's gradient reached the pipeline (the last output's time is kept); the gradient is
        unchanged."""
        entry["gradient"] = self.clock()

    def backward_done(self, run, records) -> None:
        """Close the step's host timing when its backward is done and hand it to the sink."""
        entry = self.pending.pop(run.step, None)
        self.last_end = self.clock()
        if entry is None:
            return
        between = None
        if "gradient" in entry:
            home = [r.end for r in records if r.queue == DOWNLOAD and r.stage.startswith("F")]
            between = max(0.0, entry["gradient"] - (max(home) if home else entry["returned"]))
        self.sink.append((between, entry["outside"]))  # ``PlanKeeper.observe_host``, at its next read
