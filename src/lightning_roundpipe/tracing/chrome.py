"""Chrome / Perfetto trace export of trace records, and reading one back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ..schedule.graph_task import TRACE_LANES
from .records import HOST_WORKER, TraceRecord



def _task_name(r: TraceRecord) -> str:
    """Short label such as ``F2 mb3 forward``; parts that do not apply are left out."""
    parts = [r.stage] if r.stage else []
    if r.microbatch >= 0:
        parts.append(f"mb{r.microbatch}")
    parts.append(r.kind)
    return " ".join(parts)


def queue_rank(queue: str) -> int:
    """Where a queue's row goes among a worker's rows (unknown queues last)."""
    return TRACE_LANES.index(queue) if queue in TRACE_LANES else len(TRACE_LANES)


def _queue_tids(records: Sequence[TraceRecord]) -> dict[str, int]:
    """Integer thread id per queue (Perfetto wants integers); known queues keep fixed ids."""
    tids = {q: i for i, q in enumerate(TRACE_LANES)}
    for q in sorted({r.queue for r in records} - set(TRACE_LANES)):
        tids[q] = len(tids)
    return tids


def to_chrome_trace(records: Sequence[TraceRecord], path: str | Path | None = None) -> dict:
    """Chrome / Perfetto trace of the records; also written as JSON to ``path`` when given.

    One complete event (``ph="X"``) per record, in record order, with ``ts``/``dur`` in
    microseconds, ``pid`` = worker index and ``tid`` = the queue's fixed id (upload 0,
    compute 1, download 2, host 3). Host tasks get their own process, ``pid`` = largest worker
    index + 1, named ``host``. ``args`` carry ``worker``, ``queue``, ``kind``, ``stage``,
    ``microbatch``, ``bytes`` and ``step``, so ``from_chrome_trace`` can rebuild the
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
    """Rebuild the records from a trace written by ``to_chrome_trace``.

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
    """``from_chrome_trace`` of the JSON file at ``path``."""
    return from_chrome_trace(json.loads(Path(path).read_text()))
