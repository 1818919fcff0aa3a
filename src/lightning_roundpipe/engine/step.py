"""One pipelined call over a pool: its context, its lowered task graph submitted, its phases, its measurements.

The rules (which tasks, on which worker and lane, waiting for what, at which priority) are in
``schedule/lowering.py``; what each task kind does with tensors is in ``task_work.py``. A call
reads only its ``StepContext`` (built once per plan by the engine, never the engine itself),
drops each device value once its last reader ran (``DeviceReaders``), and the host adds stage
gradients in dispatch order.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..host.compile_clock import COMPILE_CLOCK
from ..options import EngineOptions
from ..params.weights import HostGradBuffers, StageWeights, accumulate_host_grads
from ..schedule.dispatch_order import Schedule
from ..schedule.history import LoweredSteps, WorkerHistory
from ..schedule.lowering import GraphTask, LoweringOptions, TaskGraph, TaskKind
from ..schedule.plan import Plan, Stage
from ..workers.completions import Completion, TaskLabel
from ..workers.pool import WorkerPool
from .microbatch import HostCarry, OutputAssembly, batch_size_of
from .rng import CallRng
from .task_work import HANDLERS, TaskWork

__all__ = ["HostCarry", "StepContext", "StepRun", "TableSizes"]


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
    # Graphs lowered once per kind of call (``schedule/history.py``), keyed by what decides them.
    lowered: dict = field(default_factory=dict, compare=False, repr=False)
    stages: dict = field(default_factory=dict, compare=False, repr=False)  # stage name -> Stage, once per plan
    weight_tables: dict = field(default_factory=dict, compare=False, repr=False)  # ``stage_weights``'s, by key

    def __post_init__(self) -> None:
        self.stages.update({s.name: s for s in self.plan.forward_stages() + self.plan.backward_stages()})

    def stage_weights(self, stage: Stage, need_grads: bool) -> StageWeights:
        """``stage``'s weights with nothing uploaded yet. Their tables (layout, dtypes, chunks) are made
        once per stage, need of gradients and trainable flags of its tensors, not for every call."""
        o = self.options
        trainable = tuple(t.requires_grad for table in self.tables[stage.start:stage.end] for t in table.tensors)
        key = (stage.start, stage.end, need_grads, trainable)
        made = self.weight_tables.get(key)
        if made is None:
            made = StageWeights(self.tables, range(stage.start, stage.end), o.compute_dtype, o.chunk_bytes,
                                need_grads, self.shadows)
            self.weight_tables[key] = made
        return made.fresh()

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


# ---------------------------------------------------------------------------- device values
# An upload's or a compute's value lives on a worker's device; a worker holds a microbatch's tensors
# only until every task that depends on them has run.

# Kinds that depend on computes without reading their values: a weight-gradient download reads
# the gradients the stage's computes accumulated on the device, and depends on every microbatch's
# compute only so that any one's failure fails it. Counted as readers, they would keep every
# microbatch's output on the device until the stage ends.
NOT_READING = ("wgrad",)


def device_readers(graph: TaskGraph) -> dict[int, int]:
    """Per upload or compute task of ``graph`` (its value is on the device), how many tasks read it."""
    out: dict[int, int] = {}
    for t in graph.tasks:
        if t.kind in NOT_READING:
            continue
        for d in t.deps:
            if graph.tasks[d].lane in ("upload", "compute"):
                out[d] = out.get(d, 0) + 1
    return out


class DeviceReaders:
    """Reference counts of a call's device values, over the call's task completions ``done``."""

    def __init__(self, graph: TaskGraph, done: dict[int, Completion]) -> None:
        self.done = done
        self._readers = device_readers(graph)
        self._lock = threading.Lock()

    def __contains__(self, task_id: int) -> bool:
        return task_id in self._readers

    def add_backward(self, graph: TaskGraph) -> None:
        """A second backward of the call: its backward tasks read the forward's values afresh."""
        with self._lock:
            self._readers.update({d: n for d, n in device_readers(graph).items() if graph.tasks[d].phase == "backward"})

    def reading(self, fn: Callable, deps) -> Callable:
        """``fn``, then drop the values of those of ``deps`` on a device that no other dependant will read."""
        device_deps = [d for d in deps if d in self._readers]
        if not device_deps:
            return fn

        def run():
            try:
                return fn()
            finally:
                with self._lock:
                    for d in device_deps:
                        self._readers[d] -= 1
                        if self._readers[d] == 0:
                            self.done[d].drop_value()

        return run

    def drop_all(self) -> None:
        """After a failed call: forget every device value (their readers will not run)."""
        with self._lock:
            for d in self._readers:
                if d in self.done:
                    self.done[d].drop_value()


def call_measurements(pool: WorkerPool, step: int, stages: dict[str, Stage], kept_graph: bool
                      ) -> list[tuple[Stage, str, float]]:
    """(stage, kind, seconds) of every compute task of call ``step``.

    Kinds are "forward", "fused", and "backward" (with recompute, i.e. not ``kept_graph``:
    "recompute_backward", the recompute and the backward proper in one task; with layer-grain
    recompute, backward and fused tasks are "layer_recompute_backward": a forward without grad,
    the recompute and the backward). Read once every compute has finished (after backward, or
    after an evaluation forward); the records are dropped then unless the timeline keeps them.
    """
    pool.finish_step()  # device backends add their task records here
    trace = pool.trace
    records = [r for r in trace.records(step) if r.queue == "compute"] if trace.recording else []
    if not trace.enabled:
        trace.discard_step(step)
    out = []
    for r in records:
        stage = stages.get(r.stage)
        if stage is None:
            continue
        if r.kind in ("layer_backward", "layer_fused"):
            kind = "layer_recompute_backward"
        else:
            kind = "recompute_backward" if r.kind == "backward" and not kept_graph else r.kind
        out.append((stage, kind, r.duration))
    return out


# ---------------------------------------------------------------------------- the call

class StepRun:
    """One forward (+ backward) call: submits the lowered task graph, holds host activations and gradients."""

    def __init__(self, ctx: StepContext, microbatches: list[Any], *, step: int, autocast: dict, training: bool,
                 loss_scale: float | None, input_requires_grad: bool):
        self.ctx = ctx
        self.pool = ctx.pool
        self.plan = ctx.plan
        self.M = len(microbatches)
        self.training = training
        self.fused = training and loss_scale is not None and self.plan.fused_last
        self.loss_scale = loss_scale
        self.input_requires_grad = input_requires_grad
        # A seed per (layer, microbatch): recompute draws what forward drew.
        self.rng = CallRng(timeout_s=self.pool.timeout_s, owner=self.pool, task_of=self.pool.task_text)
        self.step = step
        self.compile_mark = COMPILE_CLOCK.seconds()  # a call that compiles measures its compiles
        self.backwards = 0  # backward phases submitted (a second one recomputes: the first freed kept graphs)
        self.graph: TaskGraph = ctx.lower(self.M, training=training, fused=self.fused,
                                          input_gradient=input_requires_grad)
        self.done: dict[int, Completion] = {}  # graph task id -> its completion
        self.readers = DeviceReaders(self.graph, self.done)
        # Downloads in reused host buffers that this call may read again (activations, for the
        # recompute of every backward, a second one included; a fused call's weight gradients):
        # they go back to the pool when the call is gone.
        self.lent_buffers: list = []
        weakref.finalize(self, self.pool.release_host, self.lent_buffers)
        self.work = TaskWork(ctx, self.graph, self.done, microbatches, training=training, fused=self.fused,
                             loss_scale=loss_scale, input_requires_grad=input_requires_grad, autocast=autocast,
                             rng=self.rng, lent_buffers=self.lent_buffers)
        self.host_work: list[tuple[StageWeights, Completion, list, bool]] = []  # weight-gradient downloads, dispatch order
        self.output_spec = None  # the merged output's tree spec, and per leaf whether it is floating
        self.output_is_float: list[bool] = []
        self.output_sizes: list = []  # per microbatch, its output tree (to split the output's gradients)
        # The caller's merged output (a call with loss_scale returns the summed losses: nothing to merge).
        self.outputs = OutputAssembly([batch_size_of(mb) for mb in microbatches] if loss_scale is None else [])
        self._measurements: list | None = None
        self.grad_scale: float | None = None  # what the fused run's results are multiplied by (submit_backward)

    def record_outputs(self, spec, is_float: list[bool], sizes: list) -> None:
        """What the forward returned to autograd, for splitting the gradients its backward gets."""
        self.output_spec, self.output_is_float, self.output_sizes = spec, is_float, sizes

    def _wait(self, c: Completion) -> Any:
        return c.wait(self.pool.timeout_s, waiter="the host thread", diagnose=self.pool.diagnose)

    # ------------------------------------------------------------------ submission
    def _submit(self, tasks: list[GraphTask]) -> None:
        """Submit graph tasks in order: the graph's deps, the history waits, and each kind's tensor work."""
        history = self.ctx.history
        for t in tasks:
            worker = self.pool.workers[t.worker]
            fn, nbytes, extra = HANDLERS[t.kind](self.work, t, worker)
            fn = self.readers.reading(fn, t.deps if t.kind not in NOT_READING else ())
            deps = [self.done[d] for d in t.deps] + history.resolve(t, usable=lambda c: not c.failed()) + extra
            kind = "release" if t.kind == TaskKind.FREE_KEPT else ("layer_" + t.kind if t.grain == "layer" else str(t.kind))
            label = TaskLabel(kind, t.stage, t.microbatch, t.worker, t.lane)
            c = worker.submit(t.lane, fn, deps, label, priority=t.priority, nbytes=nbytes,
                              always=t.kind in (TaskKind.RELEASE, TaskKind.FREE_KEPT))
            self.done[t.id] = c
            history.record(t, c)

    def drop_device_values(self) -> None:
        """After a failed call: forget every device value and kept graph (their readers will not run)."""
        self.readers.drop_all()
        self.work.graphs.clear()

    # ------------------------------------------------------------------ forward
    def forward(self, after_submit=None) -> list[HostCarry]:
        """Submit the forward phase; return each microbatch's output carry (host).

        A fused run's forward phase holds the backward stages too (backward is linear in the
        loss's gradient, so they run for a gradient of 1 while the host goes on).
        ``after_submit``: called once the phase is submitted, before anything is waited for (the
        engine finishes the previous call's backward tail there, while this forward runs)."""
        tasks = [t for t in self.graph.tasks if t.phase == "forward"]
        self._submit(tasks)
        if after_submit is not None:
            after_submit()
        if self.fused:
            self.host_work = self.work.wgrad_work(tasks)
            return []
        L = self.plan.num_layers
        homes = sorted((t for t in tasks if t.kind == TaskKind.ACT_OUT and t.boundary == L), key=lambda t: t.microbatch)
        outs = []
        for t in homes:  # each into its rows of the merged output while later microbatches still run
            out = self._wait(self.done[t.id])
            self.outputs.add(len(outs), out)
            outs.append(out)
        self.rng.finish_forward()
        return outs

    def fused_loss(self) -> torch.Tensor:
        """The sum of the fused last stage's per-microbatch losses, in microbatch order."""
        total = torch.zeros((), dtype=torch.float32)
        for t in self.graph.tasks:  # fixed order: microbatch 0..M-1
            if t.kind == TaskKind.LOSS:
                total = total + self._wait(self.done[t.id])[0]
        self.rng.finish_forward()
        return total * self.loss_scale

    # ------------------------------------------------------------------ backward
    def backward(self, output_grads: list[HostCarry | None], incoming_scale: float | None = None,
                 accumulate: bool = True) -> list[list | None]:
        """Add every stage's weight gradients to the host ``.grad`` (dispatch order); return input grads.

        ``accumulate=False`` (``torch.autograd.grad`` for the inputs only): leave ``.grad`` alone.

        Ordinary runs submit the backward phase now. A fused run submitted it already: here its
        results are only multiplied by ``incoming_scale``. The same as ``submit_backward`` then
        ``finish_backward``.
        """
        self.submit_backward(output_grads, incoming_scale)
        return self.finish_backward(accumulate)

    def submit_backward(self, output_grads: list[HostCarry | None], incoming_scale: float | None = None) -> None:
        """Submit the backward phase (a fused run's is submitted already); return without waiting."""
        if self.fused:
            self.grad_scale = incoming_scale
            return
        self.work.output_grads = list(output_grads)
        if self.backwards:  # a second backward of this call (retain_graph=True)
            self._relower_backward()  # the first one freed the kept graphs: recompute from the stage inputs
        tasks = [t for t in self.graph.tasks if t.phase == "backward"]
        self._submit(tasks)
        self.backwards += 1
        self.host_work = self.work.wgrad_work(tasks)
        self.grad_scale = None

    def finish_backward(self, accumulate: bool = True) -> list[list | None]:
        """The host's tail of a submitted backward: wait for every stage's weight gradients and add
        them to ``.grad`` in dispatch order, then bring the input gradients home (if asked for)."""
        ctx = self.ctx
        scale = self.grad_scale
        # Host side: gradients into .grad in dispatch order (deterministic whatever the timing).
        for weights, wg, chunk, last in self.host_work:
            grads = self._wait(wg)
            if accumulate:
                accumulate_host_grads(weights, grads, scale, ctx.grad_buffers, chunk)
                if last:  # every chunk of the stage is in: its layers' .grad are complete
                    ctx.grads_accumulated(weights.layer_ids)
            if not self.fused:  # each backward downloads afresh: these are read once, here
                kept = {id(p.grad) for p in weights.host if p.grad is not None}
                self.pool.release_host([g for g in grads if g is not None and id(g) not in kept])
                wg.drop_value()  # the worker's gradients (the CPU backend hands them over) go now
        if not self.input_requires_grad:
            self.pool.finish_step()  # device timings of the step into the trace, read once
            return [None] * self.M
        firsts = sorted((t for t in self.graph.tasks if t.kind == TaskKind.GRAD_OUT and t.boundary == 0),
                        key=lambda t: t.microbatch)
        trees = [self._wait(self.done[t.id]) for t in firsts]
        self.pool.finish_step()
        if scale is not None and scale != 1.0:
            trees = [HostCarry([x * scale if isinstance(x, torch.Tensor) else x for x in t.leaves], t.spec) for t in trees]
        return [t.tree() for t in trees]

    def _relower_backward(self) -> None:
        """Lower this call again so its backward phase can be submitted once more, dispatched from
        where the last stage left off, recomputing from the stage inputs. The lowering orders a
        call's tasks the same way whatever the first worker, so the new graph's forward tasks carry
        the ids of the tasks that already ran: the backward's inputs on the host resolve to their
        completions."""
        graph = self.ctx.lower(self.M, training=self.training, fused=self.fused,
                               input_gradient=self.input_requires_grad, kept_backward=False)
        old = self.graph.phase("forward")
        new = graph.phase("forward")
        assert [(a.id, a.kind, a.stage, a.microbatch) for a in old] == [(b.id, b.kind, b.stage, b.microbatch) for b in new]
        self.graph = graph
        self.work.use_graph(graph)
        self.readers.add_backward(graph)

    # ------------------------------------------------------------------ measurements
    @property
    def measurements(self) -> list[tuple[Stage, str, float]]:
        """(stage, kind, seconds) of every compute task of this call (``measurements.call_measurements``); none
        from a call during which ``torch.compile`` ran: its tasks' times hold compiles, not the stages' work."""
        if self._measurements is None:
            measured = call_measurements(self.pool, self.step, self.work.stages, self.work.keep_graph)
            self._measurements = [] if COMPILE_CLOCK.seconds() > self.compile_mark else measured
        return self._measurements
