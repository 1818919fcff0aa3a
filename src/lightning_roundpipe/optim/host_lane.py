"""A host thread that runs optimizer work, with completions and trace records.

Layer updates that wait together run lowest layer first (``submit(..., layer=)``): the next step's
forward uploads layer 0 first, and with early steps the first layers' gradients come home last,
behind a queue of later layers' updates, so in arrival order the first upload of the next step
would wait for all of them (the simulator's ``optimizer_order="layer"``: +0-1% on the reference
workload, docs/simulator.md). Everything else (the step's commit, a restore after a failure, the
before-images taken ahead) runs after every waiting layer update, in submission order. The order
changes nothing but timing: each layer's update reads only that layer's parameters, gradients and
optimizer state. A layer update submitted ``after_layers`` (one stepped without a before-image,
``overlap.py``) runs after every other waiting layer update, lowest layer first among its kind.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Callable

from ..schedule.graph_task import HOST_LANE
from ..tracing.records import HOST_WORKER, TraceRecord, TraceRecorder
from ..workers.completions import Completion, TaskLabel
from ..host.threads import host_optimizer_threads, set_intra_op_threads


class HostLane:
    """The host thread the overlapped optimizer's layer steps run on, one after another."""
    def __init__(self, trace: TraceRecorder, notifier=None, name: str = "roundpipe-optim", threads: int | None = None):
        """``notifier``: the worker pool whose lanes wait for these completions (uploads gated on
        a layer's new version), told when each one is set. ``threads``: the thread's torch intra-op
        threads, set as it starts (default: ``host_optimizer_threads(notifier)``, the usable cores
        the pool's compute lanes do not need; unset, it would take whatever count another thread
        set last, 1 during the pipelined phases)."""
        self.trace = trace
        self.threads = host_optimizer_threads(notifier) if threads is None else max(1, int(threads))
        self._notifier = notifier
        self._waiting: list = []  # heap of (rank, submission number, item); item None stops the thread
        self._count = itertools.count()
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object], label: TaskLabel, traced: bool = True,
               layer: int | None = None, after_layers: bool = False) -> Completion:
        """Run ``fn`` on the lane; ``traced=False``: bookkeeping kept off the timeline. ``layer``: a
        layer update, run before any waiting update of a higher layer and before other work; without
        it, after everything submitted before. ``after_layers``: a layer update that runs after every
        waiting update not so marked (still before other work)."""
        done = Completion(label, self._notifier)
        self._put((0, int(after_layers), layer) if layer is not None else (1, 0, 0), (fn, done, traced))
        return done

    def _put(self, rank: tuple, item) -> None:
        with self._ready:
            heapq.heappush(self._waiting, (rank, next(self._count), item))
            self._ready.notify()

    def has_waiting(self) -> bool:
        """Whether work submitted to this lane waits to run (idle work yields to it)."""
        with self._ready:
            return bool(self._waiting)

    def _next(self):
        with self._ready:
            while not self._waiting:
                self._ready.wait()
            return heapq.heappop(self._waiting)[2]

    def _loop(self) -> None:
        set_intra_op_threads(self.threads)
        while True:
            item = self._next()
            if item is None:
                return
            fn, done, traced = item
            start = self.trace.now()
            try:
                value = fn()
            except BaseException as exc:  # reaches whoever waits on the version
                done.fail_from_exception(exc)
                continue
            if traced and self.trace.enabled:
                lab = done.label
                self.trace.add(TraceRecord(HOST_WORKER, HOST_LANE, lab.kind, lab.stage, -1, 0, start, self.trace.now(),
                                           self.trace.step))
            done.set(value)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (waits up to ``timeout``)."""
        self._put((2, 0, 0), None)  # after everything submitted before
        self._thread.join(timeout)
