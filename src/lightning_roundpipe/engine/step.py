"""One pipelined call over a pool: the lowered task graph submitted, with each task kind's tensor work.

The rules (which tasks, on which worker and lane, waiting for what, at which priority) are
in :func:`lightning_roundpipe.schedule.lowering.lower`; this file attaches to each task kind
what it does with tensors, the same for every backend. The compute lane runs in submission
order, so a stage's gradient accumulates over microbatches 0..M-1 in that order, and the host
adds stage gradients in dispatch order.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call
from torch.utils import _pytree as pytree

from ..schedule.lowering import GraphTask, TaskGraph
from ..schedule.plan import Stage
from ..workers.completions import Completion, TaskLabel
from .buffers import buffer_writes
from .layer_recompute import LayerCalls, backward_by_layer, layer_inputs
from .rng import CallRng
from .stage_inputs import differentiable_inputs, kept_copy
from ..params.weights import StageWeights, accumulate_host_grads

if TYPE_CHECKING:
    from .engine import PipelineEngine


# Kinds that depend on computes without reading their values: a weight-gradient download reads
# the gradients the stage's computes accumulated on the device, and depends on every microbatch's
# compute only so that any one's failure fails it. Counted as readers, they would keep every
# microbatch's output on the device until the stage ends.
NOT_READING = ("wgrad",)


@dataclass
class HostCarry:
    """A carry on the host: its flattened leaves (tensors or plain values) and tree spec."""

    leaves: list
    spec: Any

    @staticmethod
    def of(tree: Any) -> "HostCarry":
        leaves, spec = pytree.tree_flatten(tree)
        return HostCarry(leaves, spec)

    def tree(self) -> Any:
        return pytree.tree_unflatten(self.leaves, self.spec)



class TableSizes:
    """The engine's :class:`~lightning_roundpipe.schedule.lowering.Sizes`: weight chunks from the layer tables.

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
        w = self._weights(start, end)  # chunks are runs of tensors; each waits for the whole stage's versions
        return [(start, end, w.chunk_bytes(chunk)) for chunk in w.chunks]

    def grad_chunks(self, start: int, end: int) -> list[tuple[int, int, int]]:
        return [(start, end, self._weights(start, end).grad_bytes)]  # one download per stage, even when frozen

    def boundary_bytes(self, boundary: int) -> int:
        return 0


class StepRun:
    """One forward (+ backward) call: submits the lowered task graph, holds host activations and gradients."""

    def __init__(self, engine: "PipelineEngine", microbatches: list[Any], *, training: bool, loss_scale: float | None,
                 input_requires_grad: bool):
        self.engine = engine
        self.pool = engine.pool
        self.plan = engine.plan
        self.opts = engine.options
        self.mbs = microbatches
        self.M = len(microbatches)
        self.training = training
        self.keep_graph = training and not self.opts.recompute
        self.layer_grain = training and self.opts.recompute and self.opts.layer_recompute
        self.fused = training and loss_scale is not None and self.plan.fused_last
        self.loss_scale = loss_scale
        self.input_requires_grad = input_requires_grad
        self.autocast = engine.autocast_state()
        # A seed per (layer, microbatch): recompute draws what forward drew.
        self.rng = CallRng(timeout_s=self.pool.timeout_s, owner=self.pool, task_of=self.pool.task_text)
        self.step = engine.step_count
        self.backward_submitted = False
        self.graph: TaskGraph = engine.lower_step(len(microbatches), training=training, fused=self.fused,
                                                  input_gradient=input_requires_grad)
        self.stages = {s.name: s for s in self.plan.forward_stages() + self.plan.backward_stages()}
        self.done: dict[int, Completion] = {}  # graph task id -> its completion
        # Tasks whose value lives on a device (uploads, computes): dependants yet to run. The last
        # one drops the value, so a worker holds a microbatch's tensors only until they are read.
        self._readers: dict[int, int] = _device_readers(self.graph)
        self._readers_lock = threading.Lock()
        self.weights: dict[str, StageWeights] = {}  # stage name -> its weights on its worker
        self.saves: dict[str, set[int]] = {}  # forward stage -> boundaries it sends home besides its output
        for t in self.graph:
            if t.kind == "act_save":
                self.saves.setdefault(t.stage, set()).add(t.boundary)
        self.host_inputs = [HostCarry.of(mb) for mb in microbatches]
        self.output_grads: list[HostCarry | None] = []
        self.graphs: dict[tuple[int, int], tuple[list, Any, list]] = {}  # kept forward graphs (no recompute)
        self.host_work: list[tuple[StageWeights, Completion]] = []  # weight-gradient downloads, dispatch order
        self._measurements: list | None = None
        # Downloads in reused host buffers that this call may read again (activations, for the
        # recompute of every backward, a second one included; a fused call's weight gradients):
        # they go back to the pool when the call is gone.
        self.lent_buffers: list = []
        weakref.finalize(self, self.pool.release_host, self.lent_buffers)

    # ------------------------------------------------------------------ helpers
    def _grad_keys(self, stage: Stage):
        """The carry keys that carry a gradient into this stage, if its first layer declares them."""
        return getattr(self.engine.layers[stage.start], "differentiable_carry_keys", None)

    def _wait(self, c: Completion) -> Any:
        return c.wait(self.pool.timeout_s, waiter="the host thread", diagnose=self.pool.diagnose)

    @contextlib.contextmanager
    def _compute_context(self, device: torch.device, grad: bool):
        enabled, dtype = self.autocast.get(device.type, (False, None))
        with torch.set_grad_enabled(grad):
            if enabled:
                with torch.autocast(device_type=device.type, dtype=dtype):
                    yield
            else:
                yield

    def _run_layers(self, device, weights: StageWeights, start: int, end: int, carry, mb: int, save_at=(),
                    recompute: bool = False):
        layers = self.engine.layers
        saved = {}
        for l in range(start, end):
            lock = self.engine.layer_locks[l]
            lock.acquire(self.pool.timeout_s, l, mb, self.pool.task_text)
            try:
                with self.rng.layer(device, l, mb, layers[l], recompute), buffer_writes(weights, l, layers[l], self.M, keep=not recompute):
                    carry = functional_call(layers[l], weights.params_for(l), (carry,))
            finally:
                lock.release()
            if l + 1 in save_at:
                saved[l + 1] = kept_copy(carry)  # the next layer may write it in place
        saved[end] = carry
        return saved

    # ------------------------------------------------------------------ submission
    def _submit(self, tasks: list[GraphTask]) -> None:
        """Submit graph tasks in order: the graph's deps, the history waits, and each kind's tensor work."""
        history = self.engine.history
        for t in tasks:
            worker = self.pool.workers[t.worker]
            fn, nbytes, extra = getattr(self, f"_{t.kind}")(t, worker)
            fn = self._reading(fn, [d for d in t.deps if d in self._readers] if t.kind not in NOT_READING else [])
            deps = [self.done[d] for d in t.deps] + history.resolve(t, usable=lambda c: not c.failed()) + extra
            kind = "release" if t.kind == "free_kept" else ("layer_" + t.kind if t.grain == "layer" else t.kind)
            label = TaskLabel(kind, t.stage, t.microbatch, t.worker, t.lane)
            c = worker.submit(t.lane, fn, deps, label, priority=t.priority, nbytes=nbytes,
                              always=t.kind in ("release", "free_kept"))
            self.done[t.id] = c
            history.record(t, c)

    def _reading(self, fn, device_deps: list[int]):
        """``fn``, then drop the values of ``device_deps`` that no other dependant will read."""
        if not device_deps:
            return fn

        def run():
            try:
                return fn()
            finally:
                with self._readers_lock:
                    for d in device_deps:
                        self._readers[d] -= 1
                        if self._readers[d] == 0:
                            self.done[d].drop_value()

        return run

    def drop_device_values(self) -> None:
        """After a failed call: forget every device value and kept graph (their readers will not run)."""
        with self._readers_lock:
            for d in self._readers:
                if d in self.done:
                    self.done[d].drop_value()
        self.graphs.clear()

    def _dep(self, t: GraphTask, kind: str) -> Completion | None:
        """The completion of ``t``'s dependency of ``kind`` (its input upload, its compute, ...)."""
        for d in t.deps:
            if self.graph.tasks[d].kind == kind:
                return self.done[d]
        return None

    def _source(self, t: GraphTask) -> Completion:
        """Where an input upload's carry is on the host: a download of this step, or the caller's data."""
        if t.deps:
            return self.done[t.deps[0]]
        if t.kind == "act_in":
            return Completion.done(TaskLabel("input", "", t.microbatch), self.host_inputs[t.microbatch])
        return Completion.done(TaskLabel("grad_output", "", t.microbatch), self.output_grads[t.microbatch])

    # one method per task kind: (fn, bytes, extra dependencies)
    def _weights(self, t: GraphTask, worker):
        eng, stage = self.engine, self.stages[t.stage]
        if t.stage not in self.weights:
            need_grads = stage.direction == "B" or self.keep_graph or (self.fused and self._is_fused(stage))
            self.weights[t.stage] = StageWeights(eng.tables, stage.layers, self.opts.compute_dtype,
                                                 self.opts.chunk_bytes, need_grads, eng.shadows)
            self._chunk = iter(self.weights[t.stage].chunks)
        weights, chunk = self.weights[t.stage], next(self._chunk)

        def fn():
            # Parameters are only read; buffers may be written in forward (BatchNorm statistics)
            # and must not reach the host that way.
            dev = self.pool.copy_to_device(worker, [weights.sources[i] for i in chunk], [weights.dtypes[i] for i in chunk],
                                            read_only=[weights.is_param[i] for i in chunk])
            weights.store_chunk(chunk, dev)
            worker.track_weights(weights.chunk_bytes(chunk))

        return fn, weights.chunk_bytes(chunk), eng.weight_gates(range(*t.layers))

    def _is_fused(self, stage: Stage) -> bool:
        return stage.direction == "F" and stage.index == len(self.plan.forward) - 1

    def _upload_carry(self, t: GraphTask, worker):
        src = self._source(t)

        def fn():
            host: HostCarry = src.value
            idx = [i for i, x in enumerate(host.leaves) if isinstance(x, torch.Tensor)]
            dev = self.pool.copy_to_device(worker, [host.leaves[i] for i in idx], [None] * len(idx))
            leaves = list(host.leaves)
            for i, d in zip(idx, dev):
                leaves[i] = d
            return HostCarry(leaves, host.spec)

        nbytes = _carry_bytes(src.value) if src.is_set() and src.value is not None else 0
        return fn, nbytes, []

    _act_in = _upload_carry
    _grad_in = _upload_carry

    def _download_carry(self, t: GraphTask, worker, get_tree):
        # The caller's outputs and input gradients are theirs to keep; every other carry is only
        # read by uploads of this call, so it may land in a reused host buffer.
        to_caller = (t.kind == "act_out" and t.boundary == self.plan.num_layers) or (t.kind == "grad_out" and t.boundary == 0)
        lent = self.lent_buffers

        def fn():
            host = get_tree()
            idx = [i for i, x in enumerate(host.leaves) if isinstance(x, torch.Tensor)]
            out = self.pool.copy_to_host(worker, [host.leaves[i] for i in idx], reusable=not to_caller)
            if not to_caller:
                lent.extend(out)
            leaves = list(host.leaves)
            for i, h in zip(idx, out):
                leaves[i] = h
            return HostCarry(leaves, host.spec)

        return fn, 0, []

    def _act_out(self, t: GraphTask, worker):
        comp = self.done[t.deps[0]]
        return self._download_carry(t, worker, lambda: HostCarry.of(comp.value[t.boundary]))

    _act_save = _act_out

    def _grad_out(self, t: GraphTask, worker):
        comp = self.done[t.deps[0]]
        fused = self.graph.tasks[t.deps[0]].kind == "fused"
        return self._download_carry(t, worker, (lambda: comp.value[1]) if fused else (lambda: comp.value))

    def _loss(self, t: GraphTask, worker):
        comp = self.done[t.deps[0]]
        return (lambda: self.pool.copy_to_host(worker, [comp.value[0]])), 0, []

    def _wgrad(self, t: GraphTask, worker):
        weights = self._stage_weights(t)
        lent = self.lent_buffers if self.fused else None

        def fn():
            out = self.pool.copy_to_host(worker, weights.device_grads(), reusable=True)
            if lent is not None:
                lent.extend(out)  # a fused call's gradients may be read by more than one backward
            return out

        return fn, t.bytes, []

    def _release(self, t: GraphTask, worker):
        weights = self._stage_weights(t)

        def fn():
            weights.release()
            worker.track_weights(-weights.nbytes)

        return fn, 0, []

    _free_kept = _release

    def _stage_weights(self, t: GraphTask) -> StageWeights:
        stage = self.stages[t.stage]
        if self.keep_graph and stage.direction == "B":
            return self.weights[f"F{stage.index}"]  # the forward kept them, with its graph
        return self.weights[t.stage]

    def _forward(self, t: GraphTask, worker):
        stage, i = self.stages[t.stage], t.microbatch
        weights, act_in = self.weights[t.stage], self._dep(t, "act_in")
        save_at = self.saves.get(t.stage, set())

        def fn():
            carry = act_in.value
            if self.keep_graph:
                tree = carry.tree()
                in_leaves = _leaves_requiring_grad(tree, need=stage.start > 0 or self.input_requires_grad,
                                               keys=self._grad_keys(stage))
                with self._compute_context(worker.device, grad=True):
                    out = self._run_layers(worker.device, weights, stage.start, stage.end, in_leaves[1], i)
                self.graphs[(stage.index, i)] = (in_leaves[0], carry.spec, pytree.tree_leaves(out[stage.end]))
                return {stage.end: pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out[stage.end])}
            with self._compute_context(worker.device, grad=False):
                return self._run_layers(worker.device, weights, stage.start, stage.end, carry.tree(), i, save_at)

        return fn, 0, []

    def _fused(self, t: GraphTask, worker):
        """Forward, loss and backward of the last stage at once; only the scalar and gradients come home."""
        stage, i = self.stages[t.stage], t.microbatch
        weights, act_in = self.weights[t.stage], self._dep(t, "act_in")

        if self.layer_grain:
            def fn():
                calls = self._layer_calls(worker.device, weights, i)
                inputs = layer_inputs(calls, stage.start, stage.end, act_in.value.tree(), forward=True)
                grads, loss = backward_by_layer(calls, stage.start, stage.end, inputs,
                                                stage.start > 0 or self.input_requires_grad, None, self.loss_scale)
                return loss, HostCarry(grads, act_in.value.spec)

            return fn, 0, []

        def fn():
            tree = act_in.value.tree()
            in_leaves, tree = _leaves_requiring_grad(tree, need=stage.start > 0 or self.input_requires_grad,
                                               keys=self._grad_keys(stage))
            with self._compute_context(worker.device, grad=True):
                out = self._run_layers(worker.device, weights, stage.start, stage.end, tree, i)[stage.end]
                loss_sum = out["loss_sum"]
                (loss_sum.float() * self.loss_scale).backward()
            grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in in_leaves]
            return loss_sum.detach().float(), HostCarry(grads, act_in.value.spec)

        return fn, 0, []

    def _backward(self, t: GraphTask, worker):
        stage, i = self.stages[t.stage], t.microbatch
        weights, a_in, g_in = self._stage_weights(t), self._dep(t, "act_in"), self._dep(t, "grad_in")
        kept = self.keep_graph  # as submitted: a second backward recomputes while the first may still run

        def fn():
            g_leaves = g_in.value.leaves
            if self.layer_grain:
                calls = self._layer_calls(worker.device, weights, i)
                inputs = layer_inputs(calls, stage.start, stage.end, a_in.value.tree(), forward=False)
                grads, _ = backward_by_layer(calls, stage.start, stage.end, inputs,
                                             stage.start > 0 or self.input_requires_grad, g_leaves)
                return HostCarry(grads, a_in.value.spec)
            if kept:
                in_leaves, spec, out_leaves = self.graphs.pop((stage.index, i))
            else:
                spec = a_in.value.spec
                tree = a_in.value.tree()
                in_leaves, tree = _leaves_requiring_grad(tree, need=stage.start > 0 or self.input_requires_grad,
                                               keys=self._grad_keys(stage))
                with self._compute_context(worker.device, grad=True):
                    out = self._run_layers(worker.device, weights, stage.start, stage.end, tree, i,
                                           recompute=True)[stage.end]
                out_leaves = pytree.tree_leaves(out)
            pairs = [(o, g) for o, g in zip(out_leaves, g_leaves)
                     if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
            grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in in_leaves]
            return HostCarry(grads, spec)

        return fn, 0, []

    def _layer_calls(self, device, weights: StageWeights, mb: int) -> LayerCalls:
        """One layer at a time, as :meth:`_run_layers` runs it (seed, lock, buffer rule)."""

        def run(layer, carry, forward):
            return self._run_layers(device, weights, layer, layer + 1, carry, mb, recompute=not forward)[layer + 1]

        return LayerCalls(run, lambda layer: getattr(self.engine.layers[layer], "differentiable_carry_keys", None),
                          lambda grad: self._compute_context(device, grad))

    def _wgrad_work(self, tasks: list[GraphTask]) -> list[tuple[StageWeights, Completion]]:
        return [(self._stage_weights(t), self.done[t.id]) for t in tasks if t.kind == "wgrad"]

    # ------------------------------------------------------------------ forward
    def forward(self) -> list[HostCarry]:
        """Submit the forward phase; return each microbatch's output carry (host).

        A fused run's forward phase holds the backward stages too (backward is linear in the
        loss's gradient, so they run for a gradient of 1 while the host goes on)."""
        tasks = self.graph.phase("forward")
        self._submit(tasks)
        if self.fused:
            self.host_work = self._wgrad_work(tasks)
            return []
        L = self.plan.num_layers
        outs = [t for t in tasks if t.kind == "act_out" and t.boundary == L]
        outs = [self._wait(self.done[t.id]) for t in sorted(outs, key=lambda t: t.microbatch)]
        self.rng.finish_forward()
        return outs

    def fused_loss(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32)
        for t in self.graph.tasks:  # fixed order: microbatch 0..M-1
            if t.kind == "loss":
                total = total + self._wait(self.done[t.id])[0]
        self.rng.finish_forward()
        return total * self.loss_scale

    # ------------------------------------------------------------------ backward
    def backward(self, output_grads: list[HostCarry | None], incoming_scale: float | None = None,
                 accumulate: bool = True) -> list[list | None]:
        """Add every stage's weight gradients to the host ``.grad`` (dispatch order); return input grads.

        ``accumulate=False`` (``torch.autograd.grad`` for the inputs only): leave ``.grad`` alone.

        Ordinary runs submit the backward phase now. A fused run submitted it already: here its
        results are only multiplied by ``incoming_scale``.
        """
        eng = self.engine
        if self.fused:
            scale = incoming_scale
        else:
            self.output_grads = list(output_grads)
            if self.backward_submitted:  # a second backward of this call (retain_graph=True)
                self.keep_graph = False  # the first one freed the kept graphs: recompute from the stage inputs
                self._relower_backward()
            tasks = self.graph.phase("backward")
            self._submit(tasks)
            self.backward_submitted = True
            self.host_work = self._wgrad_work(tasks)
            scale = None
        # Host side: gradients into .grad in dispatch order (deterministic whatever the timing).
        for weights, wg in self.host_work:
            grads = self._wait(wg)
            if accumulate:
                accumulate_host_grads(weights, grads, scale, eng.grad_buffers)
                eng.notify_grads_accumulated(weights.layer_ids)
            if not self.fused:  # each backward downloads afresh: these are read once, here
                kept = {id(p.grad) for p in weights.host if p.grad is not None}
                self.pool.release_host([g for g in grads if g is not None and id(g) not in kept])
                wg.drop_value()  # the worker's gradients (the CPU backend hands them over) go now
        if not self.input_requires_grad:
            self.pool.finish_step()  # device timings of the step into the trace, read once
            return [None] * self.M
        firsts = sorted((t for t in self.graph.tasks if t.kind == "grad_out" and t.boundary == 0),
                        key=lambda t: t.microbatch)
        trees = [self._wait(self.done[t.id]) for t in firsts]
        self.pool.finish_step()
        if scale is not None and scale != 1.0:
            trees = [HostCarry([x * scale if isinstance(x, torch.Tensor) else x for x in t.leaves], t.spec) for t in trees]
        return [t.tree() for t in trees]

    def _relower_backward(self) -> None:
        """Lower this call again so its backward phase can be submitted once more, dispatched from
        where the last stage left off. The lowering orders a call's tasks the same way whatever the
        first worker, so the new graph's forward tasks carry the ids of the tasks that already ran:
        the backward's inputs on the host resolve to their completions."""
        graph = self.engine.lower_step(self.M, training=self.training, fused=self.fused,
                                       input_gradient=self.input_requires_grad, kept_backward=self.keep_graph)
        old = self.graph.phase("forward")
        new = graph.phase("forward")
        assert [(a.id, a.kind, a.stage, a.microbatch) for a in old] == [(b.id, b.kind, b.stage, b.microbatch) for b in new]
        for stage in self.plan.backward_stages():
            self.weights.pop(stage.name, None)  # backward stages upload their weights again
        self.graph = graph
        with self._readers_lock:
            self._readers.update({d: n for d, n in _device_readers(graph).items() if graph.tasks[d].phase == "backward"})

    # ------------------------------------------------------------------ measurements
    @property
    def measurements(self) -> list[tuple[Stage, str, float]]:
        """(stage, kind, seconds) of every compute task of this call, read from the pool's trace records.

        Kinds are "forward", "fused", and "backward" (with recompute: "recompute_backward", the
        recompute and the backward proper in one task; with layer-grain recompute, backward and
        fused tasks are "layer_recompute_backward": a forward without grad, the recompute and
        the backward). Read once every compute has finished
        (after backward, or after an evaluation forward); the records are dropped then unless
        the timeline keeps them.
        """
        if self._measurements is None:
            self.pool.finish_step()  # device backends add their task records here
            trace = self.pool.trace
            records = [r for r in trace.records(self.step) if r.queue == "compute"] if trace.recording else []
            if not trace.enabled:
                trace.discard_step(self.step)
            out = []
            for r in records:
                stage = self.stages.get(r.stage)
                if stage is None:
                    continue
                if r.kind in ("layer_backward", "layer_fused"):
                    kind = "layer_recompute_backward"
                else:
                    kind = "recompute_backward" if r.kind == "backward" and not self.keep_graph else r.kind
                out.append((stage, kind, r.duration))
            self._measurements = out
        return self._measurements


def _leaves_requiring_grad(tree, need: bool, keys=None):
    """(leaves requiring grad, the tree the layers get: copies, safe to write in place); see stage_inputs.py."""
    return differentiable_inputs(tree, need, keys)


def _device_readers(graph: TaskGraph) -> dict[int, int]:
    """Per upload or compute task of ``graph`` (its value is on the device), how many tasks read it."""
    out: dict[int, int] = {}
    for t in graph:
        if t.kind in NOT_READING:
            continue
        for d in t.deps:
            if graph.tasks[d].lane in ("upload", "compute"):
                out[d] = out.get(d, 0) + 1
    return out


def _carry_bytes(host: HostCarry) -> int:
    return sum(x.numel() * x.element_size() for x in host.leaves if isinstance(x, torch.Tensor))
