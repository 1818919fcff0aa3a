"""Per-task timeline records, written by the worker lanes while they run.

One ``TraceRecord`` per task on any queue of any worker. Times are seconds from the
recorder's origin (``time.perf_counter`` on the CPU backend, CUDA events on the CUDA backend).
Metrics (``metrics``), the Chrome trace (``chrome``) and the PNG (``gantt``)
read them; this module only collects.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass


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
