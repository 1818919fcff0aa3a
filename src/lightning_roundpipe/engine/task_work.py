"""What each task kind does with tensors, the same for every backend, and the table from kind to handler.

A handler gets a task of the call's graph and its worker and returns ``(fn, bytes, extra
dependencies)``: ``fn`` runs on the worker's lane when the task's dependencies are done. The
compute lane runs in submission order, so a stage's gradient accumulates over microbatches
0..M-1 in that order.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ..params.weights import StageWeights
from ..schedule.lowering import GraphTask, TaskGraph, TaskKind
from ..schedule.plan import Stage
from ..workers.completions import Completion, TaskLabel
from .compiled_layers import COMPILED_LAYERS, naming_compile_failures
from .early_stop import EARLY_STOP, accumulate
from .layer_call import TensorSwap, buffer_writes, differentiable_inputs, differentiable_positions, inputs_at, kept_copy
from .layer_recompute import LayerCalls, backward_by_layer, layer_inputs
from .microbatch import HostCarry
from .rng import CallRng

Work = tuple[Callable[[], Any], int, list]  # (fn, bytes, extra dependencies)


class TaskWork:
    """The tensors of one call: stage weights on their workers, kept graphs, host carries; and the
    handler of each task kind (``HANDLERS``).

    ``ctx``: the call's ``StepContext`` (``step.py``, which imports this module). ``keep_graph``:
    forward stages keep their graphs for the backward (no recompute), as the call started; a
    backward compute without an activation upload runs on a kept graph.
    """

    def __init__(self, ctx, graph: TaskGraph, done: dict[int, Completion], microbatches: list[Any], *,
                 training: bool, fused: bool, loss_scale: float | None, input_requires_grad: bool, autocast: dict,
                 rng: CallRng, lent_buffers: list) -> None:
        self.ctx, self.pool, self.plan, self.opts = ctx, ctx.pool, ctx.plan, ctx.options
        self.graph, self.done = graph, done
        self.M = len(microbatches)
        self.keep_graph = training and not self.opts.recompute
        self.layer_grain = training and self.opts.recompute and self.opts.layer_recompute
        self.early_stop = training and self.opts.recompute and self.opts.recompute_early_stop
        self.fused, self.loss_scale, self.input_requires_grad = fused, loss_scale, input_requires_grad
        self.autocast, self.rng, self.lent_buffers = autocast, rng, lent_buffers
        self.call_layer = COMPILED_LAYERS.call if self.opts.compile_layers else TensorSwap().call
        self.stages = ctx.stages
        self.weights: dict[str, StageWeights] = {}  # stage name -> its weights on its worker
        self.saves: dict[str, set[int]] = {}  # forward stage -> boundaries it sends home besides its output
        for t in graph.tasks:
            if t.kind == TaskKind.ACT_SAVE:
                self.saves.setdefault(t.stage, set()).add(t.boundary)
        self.wgrad_slot = self.gradient_slots(graph)
        self.host_inputs = [HostCarry.of(mb) for mb in microbatches]
        self.output_grads: list[HostCarry | None] = []
        self.graphs: dict[tuple[int, int], tuple[list, Any, list]] = {}  # kept forward graphs (no recompute)
        self._quiet: bool | None = None  # quiet_call's answer once known
        self._chunk = iter(())

    def use_graph(self, graph: TaskGraph) -> None:
        """A second backward lowered the call again: its backward stages upload their weights afresh."""
        for stage in self.plan.backward_stages():
            self.weights.pop(stage.name, None)
        self.graph = graph
        self.wgrad_slot = self.gradient_slots(graph)

    @staticmethod
    def gradient_slots(graph: TaskGraph) -> dict[int, tuple[int, bool]]:
        """Per weight-gradient download: which of its stage's ``grad_chunks`` it moves, and whether it is the last."""
        counts: dict[str, int] = {}
        slots = {}
        for t in graph.tasks:
            if t.kind == TaskKind.WGRAD:
                slots[t.id] = counts.get(t.stage, 0)
                counts[t.stage] = slots[t.id] + 1
        return {i: (slot, slot == counts[graph.tasks[i].stage] - 1) for i, slot in slots.items()}

    # ------------------------------------------------------------------ helpers
    def grad_keys(self, stage: Stage):
        """The carry keys that carry a gradient into this stage, if its first layer declares them."""
        return getattr(self.ctx.layers[stage.start], "differentiable_carry_keys", None)

    @contextlib.contextmanager
    def compute_context(self, device: torch.device, grad: bool):
        """Grad mode and the precision plugin's autocast for compute on ``device``."""
        enabled, dtype = self.autocast.get(device.type, (False, None))
        with torch.set_grad_enabled(grad):
            if enabled:
                with torch.autocast(device_type=device.type, dtype=dtype):
                    yield
            else:
                yield

    @contextlib.contextmanager
    def layer_scope(self, device, weights: StageWeights, layer: int, mb: int, recompute: bool, in_quiet_run=False):
        """Around one call of ``layer`` on microbatch ``mb``: its lock, its seed, and its buffer writes sent
        home unless the call is a recompute. ``in_quiet_run``: the call is inside a ``quiet_run`` period,
        which checks the generator for the whole run (no seed, no check of its own)."""
        module = self.ctx.layers[layer]
        lock = self.ctx.layer_locks[layer]
        lock.acquire(self.pool.timeout_s, layer, mb, self.pool.task_text)
        try:
            with (contextlib.nullcontext() if in_quiet_run else self.rng.layer(device, layer, mb, module, recompute)), \
                    buffer_writes(weights, layer, module, self.M, keep=not recompute):
                yield
        finally:
            lock.release()

    def quiet_call(self) -> bool:
        """Whether no layer of this call may draw random numbers (each known not to, with its flags now):
        runs of layers then check the generator once per run (``CallRng.quiet_run``). Decided once every
        layer is known; until then (the first call with these flags), False."""
        if self._quiet is None:
            self._quiet = self.rng.all_quiet(self.ctx.layers)
        return bool(self._quiet)

    def layer_vjp(self, device, weights: StageWeights, layer: int, carry, mb: int, diff_pos: tuple,
                  out_grads: list) -> list:
        """Back-propagate ``out_grads`` through ``layer`` recomputed on ``carry`` as one compiled vjp graph
        (``recompute_early_stop``): its weight gradients are added into the stage's device ``.grad``; returns
        the gradients of ``carry``'s leaves (None where none). A layer the vjp cannot check recomputes whole
        instead (``layer_backward``) unless the option was asked for (``early_stop_required``: the step fails)."""
        enabled, dtype = self.autocast.get(device.type, (False, None))
        params = weights.params_for(layer)
        module, autocast = self.ctx.layers[layer], (device.type, bool(enabled), dtype if enabled else None)
        with self.layer_scope(device, weights, layer, mb, recompute=True):
            grads = EARLY_STOP.grads(module, params, carry, diff_pos, out_grads, autocast,
                                     required=self.opts.early_stop_required)
        if grads is None:  # the layer cannot stop early (nothing computed, nothing drawn)
            return self.layer_backward(device, weights, layer, carry, mb, diff_pos, out_grads)
        weight_grads, in_grads = grads
        accumulate(params, weight_grads)
        return in_grads

    def layer_backward(self, device, weights: StageWeights, layer: int, carry, mb: int, diff_pos: tuple,
                       out_grads: list) -> list:
        """``layer_vjp``'s result the eager way: ``layer`` recomputed whole with grad on ``carry`` (the leaves at
        ``diff_pos`` requiring grad) and ``out_grads`` back-propagated; weight gradients go into ``.grad``."""
        leaves, fed = inputs_at(carry, diff_pos)
        with self.compute_context(device, grad=True):
            out = self.run_layers(device, weights, layer, layer + 1, fed, mb, recompute=True)[layer + 1]
        pairs = [(o, g) for o, g in zip(pytree.tree_leaves(out), out_grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
        return [leaves[p].grad if p in diff_pos else None for p in range(len(leaves))]

    def run_layers(self, device, weights: StageWeights, start: int, end: int, carry, mb: int, save_at=(),
                   recompute: bool = False):
        """Run layers ``[start, end)`` on ``carry`` (each under its lock and seed); returns the carries after
        the layers in ``save_at`` and at ``end``."""
        layers = self.ctx.layers
        saved = {}
        run = range(start, end)
        quiet = (self.rng.quiet_run(device, run, mb, layers[start:end], recompute)
                 if len(run) > 1 and self.quiet_call() else contextlib.nullcontext(False))
        with quiet as in_quiet_run:
            for l in run:
                with self.layer_scope(device, weights, l, mb, recompute, in_quiet_run):
                    carry = self.call_layer(layers[l], weights.params_for(l), carry)
                if l + 1 in save_at:
                    saved[l + 1] = kept_copy(carry)  # the next layer may write it in place
        saved[end] = carry
        return saved

    def layer_calls(self, device, weights: StageWeights, mb: int) -> LayerCalls:
        """One layer at a time, as ``run_layers`` runs it (seed, lock, buffer rule)."""

        def run(layer, carry, forward):
            return self.run_layers(device, weights, layer, layer + 1, carry, mb, recompute=not forward)[layer + 1]

        def layer_vjp(layer, carry, diff_pos, grads):
            return self.layer_vjp(device, weights, layer, carry, mb, diff_pos, grads)

        return LayerCalls(run, lambda layer: getattr(self.ctx.layers[layer], "differentiable_carry_keys", None),
                          lambda grad: self.compute_context(device, grad), layer_vjp if self.early_stop else None)

    def dep(self, t: GraphTask, kind: str) -> Completion | None:
        """The completion of ``t``'s dependency of ``kind`` (its input upload, its compute, ...)."""
        for d in t.deps:
            if self.graph.tasks[d].kind == kind:
                return self.done[d]
        return None

    def source(self, t: GraphTask) -> Completion:
        """Where an input upload's carry is on the host: a download of this step, or the caller's data."""
        if t.deps:
            return self.done[t.deps[0]]
        if t.kind == TaskKind.ACT_IN:
            return Completion.done(TaskLabel("input", "", t.microbatch), self.host_inputs[t.microbatch])
        return Completion.done(TaskLabel("grad_output", "", t.microbatch), self.output_grads[t.microbatch])

    def stage_weights(self, t: GraphTask) -> StageWeights:
        """The weights a task of ``t.stage`` works on: a backward stage on a kept graph uses its forward's."""
        if t.stage in self.weights:
            return self.weights[t.stage]
        return self.weights[f"F{self.stages[t.stage].index}"]  # the forward kept them, with its graph

    def is_fused(self, stage: Stage) -> bool:
        """Whether ``stage`` is the fused last forward stage (forward, loss and backward at once)."""
        return stage.direction == "F" and stage.index == len(self.plan.forward) - 1

    def wgrad_work(self, tasks: list[GraphTask]) -> list[tuple[StageWeights, Completion, list[int], bool]]:
        """``(stage weights, completion, tensor indices, last of its stage)`` of the weight-gradient
        downloads among ``tasks``."""
        out = []
        for t in tasks:
            if t.kind == TaskKind.WGRAD:
                weights, (slot, last) = self.stage_weights(t), self.wgrad_slot[t.id]
                out.append((weights, self.done[t.id], weights.grad_chunks[slot], last))
        return out

    # ------------------------------------------------------------------ uploads
    def upload_weights(self, t: GraphTask, worker) -> Work:
        """The work of a weight upload task: the stage's parameters, cast to the compute dtype, chunk by chunk."""
        ctx, stage = self.ctx, self.stages[t.stage]
        if t.stage not in self.weights:
            need_grads = stage.direction == "B" or self.keep_graph or (self.fused and self.is_fused(stage))
            self.weights[t.stage] = ctx.stage_weights(stage, need_grads)
            self._chunk = iter(self.weights[t.stage].chunks)
        weights, chunk = self.weights[t.stage], next(self._chunk)

        def fn():
            # Parameters are only read; buffers may be written in forward (BatchNorm statistics)
            # and must not reach the host that way. Packed weights travel as their parts.
            tensors, dtypes, read_only = weights.upload_tensors(chunk)
            weights.store_chunk(chunk, self.pool.copy_to_device(worker, tensors, dtypes, read_only=read_only))
            worker.track_weights(weights.device_chunk_bytes(chunk))  # as held: fp32 leaves at 4 bytes

        return fn, weights.chunk_bytes(chunk), ctx.weight_gates(range(*t.layers))

    def upload_carry(self, t: GraphTask, worker) -> Work:
        """The work of an activation or gradient upload task."""
        src = self.source(t)

        def fn():
            host: HostCarry = src.value
            idx = [i for i, x in enumerate(host.leaves) if isinstance(x, torch.Tensor)]
            dev = self.pool.copy_to_device(worker, [host.leaves[i] for i in idx], [None] * len(idx))
            leaves = list(host.leaves)
            for i, d in zip(idx, dev):
                leaves[i] = d
            return HostCarry(leaves, host.spec)

        nbytes = src.value.nbytes() if src.is_set() and src.value is not None else 0
        return fn, nbytes, []

    # ------------------------------------------------------------------ downloads
    def download_carry(self, t: GraphTask, worker, get_tree) -> Work:
        """A download of the carry ``get_tree`` returns, to host buffers (reusable unless the caller keeps it)."""
        # The caller's outputs and input gradients are theirs to keep; every other carry is only
        # read by uploads of this call, so it may land in a reused host buffer.
        to_caller = ((t.kind == TaskKind.ACT_OUT and t.boundary == self.plan.num_layers)
                     or (t.kind == TaskKind.GRAD_OUT and t.boundary == 0))
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

    def download_activation(self, t: GraphTask, worker) -> Work:
        """The work of an activation download task."""
        comp = self.done[t.deps[0]]
        return self.download_carry(t, worker, lambda: HostCarry.of(comp.value[t.boundary]))

    def download_input_grad(self, t: GraphTask, worker) -> Work:
        """The work of an input-gradient download task."""
        comp = self.done[t.deps[0]]
        fused = self.graph.tasks[t.deps[0]].kind == TaskKind.FUSED
        return self.download_carry(t, worker, (lambda: comp.value[1]) if fused else (lambda: comp.value))

    def download_loss(self, t: GraphTask, worker) -> Work:
        """The work of a fused stage's loss download task."""
        comp = self.done[t.deps[0]]
        return (lambda: self.pool.copy_to_host(worker, [comp.value[0]])), 0, []

    def download_weight_grads(self, t: GraphTask, worker) -> Work:
        """The work of a weight-gradient download task: into the host gradient buffers."""
        weights = self.stage_weights(t)
        lent = self.lent_buffers if self.fused else None
        chunk = weights.grad_chunks[self.wgrad_slot[t.id][0]]  # one byte-bounded run of the stage's gradients

        def fn():
            out = self.pool.copy_to_host(worker, weights.device_grads(chunk), reusable=True)
            if lent is not None:
                lent.extend(out)  # a fused call's gradients may be read by more than one backward
            return out

        return fn, t.bytes, []

    def release(self, t: GraphTask, worker) -> Work:
        """The work of a release task: drop the stage's device weights."""
        weights = self.stage_weights(t)

        def fn():
            weights.release()
            worker.track_weights(-weights.device_nbytes)

        return fn, 0, []

    # ------------------------------------------------------------------ computes
    def compute_work(self, fn: Callable[[], Any]) -> Work:
        """A compute task's work: ``fn``, naming a compiler's failure inside it when layers compile."""
        return (naming_compile_failures(fn) if self.opts.compile_layers else fn), 0, []

    def forward(self, t: GraphTask, worker) -> Work:
        """The work of a forward compute task of one microbatch."""
        stage, i = self.stages[t.stage], t.microbatch
        weights, act_in = self.weights[t.stage], self.dep(t, "act_in")
        save_at = self.saves.get(t.stage, set())

        def fn():
            carry = act_in.value
            if self.keep_graph:
                tree = carry.tree()
                in_leaves = differentiable_inputs(tree, stage.start > 0 or self.input_requires_grad, self.grad_keys(stage))
                with self.compute_context(worker.device, grad=True):
                    out = self.run_layers(worker.device, weights, stage.start, stage.end, in_leaves[1], i)
                self.graphs[(stage.index, i)] = (in_leaves[0], carry.spec, pytree.tree_leaves(out[stage.end]))
                return {stage.end: pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out[stage.end])}
            with self.compute_context(worker.device, grad=False):
                return self.run_layers(worker.device, weights, stage.start, stage.end, carry.tree(), i, save_at)

        return self.compute_work(fn)

    def fused_stage(self, t: GraphTask, worker) -> Work:
        """Forward, loss and backward of the last stage at once; only the scalar and gradients come home."""
        stage, i = self.stages[t.stage], t.microbatch
        weights, act_in = self.weights[t.stage], self.dep(t, "act_in")

        if self.layer_grain:
            def fn():
                calls = self.layer_calls(worker.device, weights, i)
                inputs = layer_inputs(calls, stage.start, stage.end, act_in.value.tree(), forward=True)
                grads, loss = backward_by_layer(calls, stage.start, stage.end, inputs,
                                                stage.start > 0 or self.input_requires_grad, None, self.loss_scale)
                return loss, HostCarry(grads, act_in.value.spec)

            return self.compute_work(fn)

        def fn():
            tree = act_in.value.tree()
            in_leaves, tree = differentiable_inputs(tree, stage.start > 0 or self.input_requires_grad, self.grad_keys(stage))
            with self.compute_context(worker.device, grad=True):
                out = self.run_layers(worker.device, weights, stage.start, stage.end, tree, i)[stage.end]
                loss_sum = out["loss_sum"]
                (loss_sum.float() * self.loss_scale).backward()
            grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in in_leaves]
            return loss_sum.detach().float(), HostCarry(grads, act_in.value.spec)

        return self.compute_work(fn)

    def backward(self, t: GraphTask, worker) -> Work:
        """The work of a backward compute task of one microbatch (recompute, then back-propagate)."""
        stage, i = self.stages[t.stage], t.microbatch
        weights, a_in, g_in = self.stage_weights(t), self.dep(t, "act_in"), self.dep(t, "grad_in")
        kept = a_in is None  # on the forward's kept graph (a second backward uploads the input and recomputes)

        def fn():
            g_leaves = g_in.value.leaves
            if self.layer_grain:
                calls = self.layer_calls(worker.device, weights, i)
                inputs = layer_inputs(calls, stage.start, stage.end, a_in.value.tree(), forward=False)
                grads, _ = backward_by_layer(calls, stage.start, stage.end, inputs,
                                             stage.start > 0 or self.input_requires_grad, g_leaves)
                return HostCarry(grads, a_in.value.spec)
            if kept:
                in_leaves, spec, out_leaves = self.graphs.pop((stage.index, i))
            elif self.early_stop:
                grads = self.backward_stopping_early(worker.device, weights, stage, a_in.value.tree(), i, g_leaves)
                return HostCarry(grads, a_in.value.spec)
            else:
                spec = a_in.value.spec
                tree = a_in.value.tree()
                in_leaves, tree = differentiable_inputs(tree, stage.start > 0 or self.input_requires_grad,
                                                        self.grad_keys(stage))
                with self.compute_context(worker.device, grad=True):
                    out = self.run_layers(worker.device, weights, stage.start, stage.end, tree, i,
                                          recompute=True)[stage.end]
                out_leaves = pytree.tree_leaves(out)
            pairs = [(o, g) for o, g in zip(out_leaves, g_leaves)
                     if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
            grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in in_leaves]
            return HostCarry(grads, spec)

        return self.compute_work(fn)

    def backward_stopping_early(self, device, weights: StageWeights, stage: Stage, tree, mb: int, g_leaves: list) -> list:
        """A backward stage's recompute and backward with its last layer through ``layer_vjp``
        (``recompute_early_stop``): the layers before it recompute with grad as usual, the last one recomputes
        only what its gradients need. Returns the gradients of the stage input's leaves."""
        need = stage.start > 0 or self.input_requires_grad
        last = stage.end - 1
        if stage.start == last:  # a one-layer stage: the whole stage is one vjp
            return self.layer_vjp(device, weights, last, tree, mb, differentiable_positions(tree, need, self.grad_keys(stage)),
                                  g_leaves)
        in_leaves, fed = differentiable_inputs(tree, need, self.grad_keys(stage))
        with self.compute_context(device, grad=True):
            carry = self.run_layers(device, weights, stage.start, last, fed, mb, recompute=True)[last]
        leaves = pytree.tree_leaves(carry)
        diff_pos = tuple(p for p, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad)
        carry_grads = self.layer_vjp(device, weights, last, carry, mb, diff_pos, g_leaves)
        pairs = [(x, g) for x, g in zip(leaves, carry_grads) if g is not None]
        if pairs:
            torch.autograd.backward([x for x, _ in pairs], [g.to(x.dtype) for x, g in pairs])
        return [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in in_leaves]


# Every task kind's handler: adding a kind to TaskKind without one here fails at import.
HANDLERS: dict[TaskKind, Callable[[TaskWork, GraphTask, Any], Work]] = {
    TaskKind.WEIGHTS: TaskWork.upload_weights,
    TaskKind.ACT_IN: TaskWork.upload_carry,
    TaskKind.GRAD_IN: TaskWork.upload_carry,
    TaskKind.FORWARD: TaskWork.forward,
    TaskKind.FUSED: TaskWork.fused_stage,
    TaskKind.BACKWARD: TaskWork.backward,
    TaskKind.ACT_OUT: TaskWork.download_activation,
    TaskKind.ACT_SAVE: TaskWork.download_activation,
    TaskKind.GRAD_OUT: TaskWork.download_input_grad,
    TaskKind.LOSS: TaskWork.download_loss,
    TaskKind.WGRAD: TaskWork.download_weight_grads,
    TaskKind.RELEASE: TaskWork.release,
    TaskKind.FREE_KEPT: TaskWork.release,
}
if set(HANDLERS) != set(TaskKind):
    raise ImportError(f"task kinds without a handler: {sorted(set(TaskKind) - set(HANDLERS))}")
