"""What every call of an engine needs, built once by the engine: a step reads this, never the engine.

The engine rebuilds the context when its plan or microbatch count changes
(``set_plan``); a call keeps the one it started with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from ..options import EngineOptions
from ..params.weights import HostGradBuffers, StageWeights
from ..schedule.dispatch_order import Schedule
from ..schedule.history import WorkerHistory
from ..schedule.lowered_steps import LoweredSteps
from ..schedule.lowering import LoweringOptions, TaskGraph
from ..schedule.plan import Plan
from ..workers.completions import Completion
from ..workers.pool import WorkerPool


class TableSizes:
    """The engine's ``Sizes``: weight chunks from the layer tables.

    Activation bytes are only known when a task runs (the carries' shapes), so they are 0 here.
    """

    def __init__(self, tables, compute_dtype, chunk_bytes: int) -> None:
        self.tables, self.compute_dtype, self.chunk_bytes = tables, compute_dtype, chunk_bytes
        self._cache: dict[tuple[int, int], StageWeights] = {}

    def _weights(self, start: int, end: int) -> StageWeights:
        if (start, end) not in self._cache:
            self._cache[(start, end)] = StageWeights(self.tables, range(start, end), self.compute_dtype,
                                                     self.chunk_bytes, need_grads=True)
        return self._cache[(start, end)]

    def weight_chunks(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(start, end, bytes)`` of each upload chunk of the weights of layers ``[start, end)``."""
        w = self._weights(start, end)  # chunks are runs of tensors; each waits for the whole stage's versions
        return [(start, end, w.chunk_bytes(chunk)) for chunk in w.chunks]

    def grad_chunks(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(start, end, bytes)`` of each gradient download of layers ``[start, end)``: runs of about
        ``chunk_bytes`` (``StageWeights.grad_chunks``); one, empty, when nothing is trainable."""
        w = self._weights(start, end)
        return [(start, end, w.grad_chunk_bytes(chunk)) for chunk in w.grad_chunks]

    def boundary_bytes(self, boundary: int) -> int:
        """Bytes of the activation at a stage boundary: not known before the step runs (0)."""
        return 0


@dataclass(frozen=True)
class StepContext:
    """The engine's share of a call: its layers, pool, plan and options, the dispatch state across
    calls, and the hooks a call reports to (new weight versions to wait for, gradients on the host)."""

    layers: tuple
    layer_locks: tuple  # per layer: the lock of its module object (engine._shared_module_locks)
    tables: tuple  # per layer: its LayerTable
    pool: WorkerPool
    plan: Plan
    options: EngineOptions
    schedule: Schedule
    history: WorkerHistory  # the schedule's cursor and each worker's recent tasks, across calls
    grad_buffers: HostGradBuffers
    weight_gates: Callable[[range], list[Completion]]  # completions an upload of these layers waits for
    grads_accumulated: Callable[[range], None]  # the host .grad of these layers holds this call's gradients
    shadows: Any = None  # a ShadowStore: uploads read compute-dtype copies of the masters
    # Graphs lowered once per kind of call (``schedule/lowered_steps.py``), keyed by what decides them.
    lowered: dict = field(default_factory=dict, compare=False, repr=False)

    def lower(self, microbatches: int, *, training: bool, fused: bool, input_gradient: bool,
              kept_backward: bool = True) -> TaskGraph:
        """The next call's task graph, dispatched from where the previous one left off.

        The plan and the options are the context's own; what else decides the graph is this
        call's kind and which tensors are trainable now (a stage with nothing trainable downloads
        no gradient bytes). A graph of the same key was lowered once; later calls get it turned
        to their first worker and re-numbered (``LoweredSteps``), as ``lower`` itself would give."""
        o = self.options
        priorities = dict(o.priorities)
        trainable = tuple(t.requires_grad for table in self.tables for t in table.tensors)
        key = (microbatches, training, fused, input_gradient, kept_backward, o.recompute, o.layer_recompute,
               int(o.prefetch_depth), tuple(sorted(priorities.items())), self.schedule, o.compute_dtype,
               o.chunk_bytes, trainable)
        steps = self.lowered.get(key)
        if steps is None:  # the first call of its kind
            engine = o if o.microbatches == microbatches else dataclasses.replace(o, microbatches=microbatches)
            options = LoweringOptions(engine, training=training, fused=fused, kept_backward=kept_backward,
                                      input_gradient=input_gradient)
            steps = LoweredSteps(self.plan, len(self.pool), TableSizes(self.tables, o.compute_dtype, o.chunk_bytes),
                                 options)
            self.lowered[key] = steps
        graph = steps.graph(self.history.next_worker, self.history.next_serial + 1)
        self.history.advance(graph)
        return graph
