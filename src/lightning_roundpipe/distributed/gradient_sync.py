"""Data parallel across nodes: one process per node, gradients averaged on the host buffers.

Each node runs RoundPipe over its own workers; once a layer's gradients are complete on the host,
they are all-reduced asynchronously over gloo, overlapping the rest of backward, and waited for
before that layer steps. Accumulation-only steps communicate nothing. A watcher thread records
each reduction on the timeline; a dead peer fails the reduction after the process-group timeout,
naming rank, layer and timeout. Details: docs/design.md, design notes,
``distributed/gradient_sync.py``.
"""

from __future__ import annotations

from datetime import timedelta

import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import NodeSyncError, PipelineError
from ..params.weights import group_by_lowest_layer
from ..tracing.records import TraceRecord, TraceRecorder
from ..host.threads import WAITING_THREADS, set_intra_op_threads


@dataclass
class _Pending:
    unit: int
    params: list
    buffer: torch.Tensor
    work: object
    start: float
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    finalized: bool = False


class GradientSync:
    """All-reduces each layer's gradients across nodes as soon as they are complete (see the module doc)."""
    def __init__(self, layer_tables, trace: TraceRecorder, timeout_s: float, group=None):
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.group = group
        self.trace = trace
        self.timeout_s = timeout_s
        self.blocked = False  # True while Lightning accumulates without stepping
        trainable = {id(t) for table in layer_tables for t in table.tensors if t.requires_grad}
        self.unit_params, self.unit_layers = group_by_lowest_layer(layer_tables, trainable)
        self._done_layers: set[int] = set()
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self.bytes_reduced = 0  # this step
        self._watch: queue.Queue = queue.Queue()
        self._watcher = threading.Thread(target=self._watch_loop, name="roundpipe-allreduce", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ the engine's report (via the runtime)
    def on_grads_ready(self, layer_ids) -> None:
        """Start the reduction of the units whose layers' gradients are all complete (nothing while
        accumulating)."""
        if self.blocked:
            return
        self._done_layers.update(layer_ids)
        for unit, layers in self.unit_layers.items():
            if unit not in self._pending and layers <= self._done_layers:
                self._launch(unit)

    def _launch(self, unit: int) -> None:
        params = [p for p in self.unit_params[unit] if p.grad is not None]
        if not params:
            return
        buffer = torch.cat([p.grad.reshape(-1) for p in params])
        self.bytes_reduced += buffer.numel() * buffer.element_size()
        work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        pending = _Pending(unit, params, buffer, work, self.trace.now())
        self._pending[unit] = pending
        self._watch.put(pending)

    def _watch_loop(self) -> None:
        set_intra_op_threads(WAITING_THREADS)  # explicit: unset, a thread takes whatever count was set last
        while True:
            pending = self._watch.get()
            if pending is None:
                return
            try:
                pending.work.wait(timedelta(seconds=self.timeout_s))  # whatever the group's own timeout
            except BaseException as exc:  # gloo raises when a peer is gone
                pending.error = exc
            if self.trace.enabled:
                nbytes = pending.buffer.numel() * pending.buffer.element_size()
                self.trace.add(TraceRecord(-1, "host", "allreduce", f"L{pending.unit}", -1, nbytes, pending.start,
                                           self.trace.now(), self.trace.step))
            pending.done.set()

    # ------------------------------------------------------------------ completion
    def finalize(self, unit: int) -> None:
        """Wait for a unit's reduction and write the averaged gradients back (once; thread-safe)."""
        pending = self._pending.get(unit)
        if pending is None:
            return
        if not pending.done.wait(self.timeout_s):
            raise NodeSyncError(
                f"rank {self.rank}: the gradient all-reduce of layer {unit} did not finish within {self.timeout_s:g}s; "
                f"a peer node of the {self.world} may have died or cannot be reached"
            )
        with self._lock:
            if pending.finalized:
                return
            if pending.error is not None:
                raise NodeSyncError(
                    f"rank {self.rank}: the gradient all-reduce of layer {unit} failed ({pending.error}); a peer node of "
                    f"the {self.world} died or cannot be reached (timeout {self.timeout_s:g}s)"
                ) from pending.error
            pending.buffer.div_(self.world)
            offset = 0
            for p in pending.params:
                n = p.grad.numel()
                p.grad.copy_(pending.buffer[offset: offset + n].view_as(p.grad))
                offset += n
            pending.finalized = True

    def finalize_params(self, params) -> None:
        """Wait for the reductions holding ``params`` and copy the averaged gradients back."""
        ids = {id(p) for p in params}
        for unit, ps in self.unit_params.items():
            if any(id(p) in ids for p in ps):
                self.finalize(unit)

    def finish_backward(self, other_params=()) -> None:
        """End of a synced backward: every launched reduction is in; parameters outside the pipeline too."""
        if self.blocked:
            return
        for unit in list(self._pending):
            self.finalize(unit)
        for p in other_params:
            if p.grad is not None:
                self.bytes_reduced += p.grad.numel() * p.grad.element_size()
                dist.all_reduce(p.grad, group=self.group)
                p.grad.div_(self.world)

    def begin_backward(self, accumulating: bool) -> None:
        """Before a backward: an accumulation-only one communicates nothing, a synced one starts afresh."""
        self.blocked = accumulating
        if not accumulating:
            self.new_step()

    def new_step(self) -> None:
        """Forget the previous step's reductions."""
        self._done_layers = set()
        self._pending = {}
        self.bytes_reduced = 0

    def close(self) -> None:
        """Stop the watcher thread."""
        self._watch.put(None)
        self._watcher.join(5)


def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Make every node start from rank ``src``'s parameters and buffers."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src)
