"""Timeline export and metrics over :class:`~lightning_roundpipe.tracing.records.TraceRecord` lists.

The engine records one :class:`TraceRecord` per task (see ``trace.py``); this module turns a list
of them into

- a Chrome / Perfetto trace (:func:`to_chrome_trace`, read back by :func:`from_chrome_trace`),
- a Gantt chart PNG (:func:`save_gantt_png`, needs the ``plot`` extra: matplotlib),
- numbers that say how well the pipeline overlaps work: :func:`bubble_fraction`,
  :func:`exposed_transfer_seconds`, :func:`hidden_share`, :func:`step_metrics` and
  :func:`summarize_by_step`.

Command line: ``python -m lightning_roundpipe.tracing.timeline trace.json --png out.png`` reads a trace
written by :func:`to_chrome_trace`, prints the per-step metrics and draws the chart.

Everything here is a pure function of the records: nothing touches tensors or devices.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .records import TraceRecord

# Queues in the order a worker's rows are shown (data flows upload -> compute -> download).
QUEUE_ORDER = ("upload", "compute", "download", "host")
TRANSFER_QUEUES = ("upload", "download")
HOST_WORKER = -1  # TraceRecord.worker of tasks that run on the host

Interval = tuple[float, float]

# ------------------------------------------------------------------ interval arithmetic


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


# ------------------------------------------------------------------------------ metrics


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
    transfers = _by_worker(records, TRANSFER_QUEUES)
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
    host = [(r.start, r.end) for r in records if r.queue == "host" and r.kind == kind]
    total = sum(max(0.0, end - start) for start, end in host)
    if total <= 0:
        return 0.0
    computing = _union(s for spans in _by_worker(records, ("compute",)).values() for s in spans)
    # Each host task separately (not their union), so parallel host threads each count.
    hidden = sum(_overlap_length([(s, e)], computing) for s, e in host if e > s)
    return hidden / total


def step_metrics(records: Sequence[TraceRecord], tokens: int | None) -> dict:
    """The headline numbers of one step (or of any window of records).

    Keys: ``bubble_fraction`` (:func:`bubble_fraction`), ``exposed_transfer_s``
    (:func:`exposed_transfer_seconds`), ``optim_hidden_share`` (:func:`hidden_share` of the
    ``"optim"`` host tasks), ``step_s`` (first start to last end over all records),
    ``tokens`` and ``tokens_per_s`` (``tokens / step_s``; ``None`` when ``tokens`` is ``None``,
    0.0 when ``step_s`` is 0).
    """
    step_s = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    if tokens is None:
        tokens_per_s = None
    else:
        tokens_per_s = tokens / step_s if step_s > 0 else 0.0
    return {
        "bubble_fraction": bubble_fraction(records),
        "exposed_transfer_s": exposed_transfer_seconds(records),
        "optim_hidden_share": hidden_share(records, "optim"),
        "step_s": step_s,
        "tokens": tokens,
        "tokens_per_s": tokens_per_s,
    }


def summarize_by_step(
    records: Sequence[TraceRecord], tokens: int | Mapping[int, int] | None = None
) -> dict[int, dict]:
    """:func:`step_metrics` for each training step, keyed by step number in ascending order.

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


# ------------------------------------------------------------------------- chrome trace


def _task_name(r: TraceRecord) -> str:
    """Short label such as ``F2 mb3 forward``; parts that do not apply are left out."""
    parts = [r.stage] if r.stage else []
    if r.microbatch >= 0:
        parts.append(f"mb{r.microbatch}")
    parts.append(r.kind)
    return " ".join(parts)


def _queue_rank(queue: str) -> int:
    return QUEUE_ORDER.index(queue) if queue in QUEUE_ORDER else len(QUEUE_ORDER)


def _queue_tids(records: Sequence[TraceRecord]) -> dict[str, int]:
    """Integer thread id per queue (Perfetto wants integers); known queues keep fixed ids."""
    tids = {q: i for i, q in enumerate(QUEUE_ORDER)}
    for q in sorted({r.queue for r in records} - set(QUEUE_ORDER)):
        tids[q] = len(tids)
    return tids


def to_chrome_trace(records: Sequence[TraceRecord], path: str | Path | None = None) -> dict:
    """Chrome / Perfetto trace of the records; also written as JSON to ``path`` when given.

    One complete event (``ph="X"``) per record, in record order, with ``ts``/``dur`` in
    microseconds, ``pid`` = worker index and ``tid`` = the queue's fixed id (upload 0,
    compute 1, download 2, host 3). Host tasks get their own process, ``pid`` = largest worker
    index + 1, named ``host``. ``args`` carry ``worker``, ``queue``, ``kind``, ``stage``,
    ``microbatch``, ``bytes`` and ``step``, so :func:`from_chrome_trace` can rebuild the
    records. Metadata events (``ph="M"``) name and order the rows ("worker 0" / "upload").
    Open the file at https://ui.perfetto.dev or chrome://tracing.
    """
    workers = sorted({r.worker for r in records if r.worker != HOST_WORKER})
    host_pid = (workers[-1] + 1) if workers else 0
    tids = _queue_tids(records)

    def pid_of(worker: int) -> int:
        return host_pid if worker == HOST_WORKER else worker

    events: list[dict] = []
    rows = sorted({(r.worker, r.queue) for r in records}, key=lambda wq: (wq[0] == HOST_WORKER, wq[0]))
    for worker in dict.fromkeys(w for w, _ in rows):
        pid = pid_of(worker)
        name = "host" if worker == HOST_WORKER else f"worker {worker}"
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        # Workers in index order, the host last.
        sort_index = len(workers) if worker == HOST_WORKER else worker
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort_index}})
    for worker, queue in rows:
        pid, tid = pid_of(worker), tids[queue]
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": queue}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for r in records:
        events.append(
            {
                "ph": "X",
                "name": _task_name(r),
                "cat": r.kind,
                "pid": pid_of(r.worker),
                "tid": tids[r.queue],
                "ts": r.start * 1e6,
                "dur": (r.end - r.start) * 1e6,
                "args": {
                    "worker": r.worker,
                    "queue": r.queue,
                    "kind": r.kind,
                    "stage": r.stage,
                    "microbatch": r.microbatch,
                    "bytes": r.bytes,
                    "step": r.step,
                },
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def from_chrome_trace(trace: dict | list) -> list[TraceRecord]:
    """Rebuild the records from a trace written by :func:`to_chrome_trace`.

    Accepts the object form (``{"traceEvents": [...]}``) or a bare event list. Every complete
    event becomes a record, in event order. Times come back from microseconds, so they equal the
    originals up to float rounding (exactly, for times such as 0.25 s that are exact in binary).
    Raises ``ValueError`` naming the event when one lacks the ``args`` this module writes.
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    records = []
    for index, event in enumerate(events):
        if event.get("ph") != "X":
            continue
        args = event.get("args", {})
        missing = [k for k in ("worker", "queue", "kind", "stage", "microbatch", "bytes", "step") if k not in args]
        if missing:
            raise ValueError(
                f"trace event {index} ({event.get('name')!r}) lacks args {missing}; "
                "from_chrome_trace reads only traces written by lightning_roundpipe.tracing.timeline.to_chrome_trace"
            )
        ts, dur = float(event["ts"]), float(event["dur"])
        records.append(
            TraceRecord(
                worker=int(args["worker"]),
                queue=str(args["queue"]),
                kind=str(args["kind"]),
                stage=str(args["stage"]),
                microbatch=int(args["microbatch"]),
                bytes=int(args["bytes"]),
                start=ts / 1e6,
                end=(ts + dur) / 1e6,
                step=int(args["step"]),
            )
        )
    return records


def load_chrome_trace(path: str | Path) -> list[TraceRecord]:
    """:func:`from_chrome_trace` of the JSON file at ``path``."""
    return from_chrome_trace(json.loads(Path(path).read_text()))


# -------------------------------------------------------------------------------- gantt

# Fixed colours for the kinds the engine records; compute kinds are strong and far apart,
# transfers are lighter. Unknown kinds take colours from a spare palette.
KIND_COLOURS = {
    "forward": "#1f77b4",  # blue
    "backward": "#d62728",  # red
    "fused": "#9467bd",  # purple
    "weights": "#aec7e8",
    "act_in": "#98df8a",
    "act_out": "#2ca02c",
    "grad_in": "#ffbb78",
    "grad_out": "#ff7f0e",
    "wgrad": "#c49c94",
    "optim": "#7f7f7f",
}
_SPARE_COLOURS = ("#17becf", "#bcbd22", "#e377c2", "#8c564b", "#dbdb8d", "#9edae5", "#f7b6d2")
# Hatching makes the three compute kinds distinguishable in grey-scale prints too.
KIND_HATCHES = {"backward": "//", "fused": "xx"}


def _colour_of(kind: str, spare: dict[str, str]) -> str:
    if kind in KIND_COLOURS:
        return KIND_COLOURS[kind]
    if kind not in spare:
        spare[kind] = _SPARE_COLOURS[len(spare) % len(_SPARE_COLOURS)]
    return spare[kind]


def save_gantt_png(records: Sequence[TraceRecord], path: str | Path, title: str | None = None) -> None:
    """Draw the records as a Gantt chart PNG at ``path``.

    One row per (worker, queue), workers in index order with their upload, compute and download
    rows, then the host. Bars are coloured by kind (forward, backward and fused compute also
    differ by hatching), wide bars are labelled with their stage, a legend names the kinds and
    the time axis is in milliseconds from the first task. Renders off-screen (Agg), so it works
    without a display and leaves pyplot's global state alone. Needs matplotlib.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "save_gantt_png needs matplotlib; install it with `pip install lightning-roundpipe[plot]`"
        ) from err
    if not records:
        raise ValueError("save_gantt_png got no records to draw; was tracing enabled for the step?")

    origin = min(r.start for r in records)
    span_ms = max((max(r.end for r in records) - origin) * 1e3, 1e-9)
    rows = sorted(
        {(r.worker, r.queue) for r in records},
        key=lambda wq: (wq[0] == HOST_WORKER, wq[0], _queue_rank(wq[1]), wq[1]),
    )
    row_of = {row: i for i, row in enumerate(rows)}

    fig = Figure(figsize=(12, 1.0 + 0.38 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    spare: dict[str, str] = {}
    kinds: dict[str, None] = {}
    for r in records:
        kinds.setdefault(r.kind)
        y = row_of[(r.worker, r.queue)]
        left, width = (r.start - origin) * 1e3, (r.end - r.start) * 1e3
        ax.barh(
            y, width, left=left, height=0.8, color=_colour_of(r.kind, spare),
            hatch=KIND_HATCHES.get(r.kind), edgecolor="black", linewidth=0.3,
        )
        # Label only bars wide enough to hold the text.
        if r.stage and width > 0.04 * span_ms:
            ax.text(left + width / 2, y, r.stage, ha="center", va="center", fontsize=7)

    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["host" if w == HOST_WORKER else f"w{w} {q}" for w, q in rows])
    ax.invert_yaxis()  # worker 0 at the top
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, span_ms)
    ax.set_title(title or "RoundPipe timeline")
    # Known kinds in the palette's order (compute first), then the others alphabetically.
    legend_kinds = [k for k in KIND_COLOURS if k in kinds] + sorted(k for k in kinds if k not in KIND_COLOURS)
    handles = [
        Patch(facecolor=_colour_of(k, spare), hatch=KIND_HATCHES.get(k), edgecolor="black", label=k)
        for k in legend_kinds
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=110)


# ---------------------------------------------------------------------------------- cli


def _format_metrics(step: int, m: dict) -> str:
    line = (
        f"step {step}: {m['step_s'] * 1e3:.3f} ms, bubble {m['bubble_fraction']:.1%}, "
        f"exposed transfers {m['exposed_transfer_s'] * 1e3:.3f} ms, optimizer hidden {m['optim_hidden_share']:.1%}"
    )
    if m["tokens_per_s"] is not None:
        line += f", {m['tokens_per_s']:.1f} tokens/s"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print per-step metrics of a Chrome trace and optionally draw it as a PNG."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_roundpipe.tracing.timeline",
        description="Read a trace written by lightning_roundpipe.tracing.timeline.to_chrome_trace, "
        "print per-step metrics and optionally draw a Gantt chart.",
    )
    parser.add_argument("trace", help="Chrome trace JSON file")
    parser.add_argument("--png", help="write a Gantt chart PNG here")
    parser.add_argument("--title", help="chart title (default: the trace file name)")
    parser.add_argument("--tokens", type=int, help="tokens per step, to report throughput")
    args = parser.parse_args(argv)

    records = load_chrome_trace(args.trace)
    for step, metrics in summarize_by_step(records, args.tokens).items():
        print(_format_metrics(step, metrics))
    if args.png:
        save_gantt_png(records, args.png, title=args.title or Path(args.trace).name)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
