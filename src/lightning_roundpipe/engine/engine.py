"""The pipeline engine: runs a plan over a worker pool, from plain PyTorch.

``engine(inputs)`` runs the pipelined forward of ``layers`` and returns the merged output; with
grad, the output is attached to a custom autograd Function, so ``loss.backward()`` runs the
pipelined backward and leaves the weight gradients in the host parameters' ``.grad``. Inside
``returning_early()`` a backward may return before its weight-gradient tail, which the next
engine entry or ``finish_backward()`` finishes ("Backward that returns early" in
docs/design.md). ``PipelineCalls`` tracks which calls still owe the weights a gradient.
Knows nothing of Lightning.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..schedule.dispatch_order import schedule_named
from ..schedule.history import WorkerHistory
from ..schedule.plan import Plan, PlanError
from ..errors import PipelineError, PipelineTimeout, WorkerError
from ..workers.completions import Completion
from ..workers.pool import WorkerPool
from ..host.threads import HOST_PHASE_THREADS
from ..options import EngineOptions
from .microbatch import HostCarry, merge_microbatches, split_microbatches
from .layer_call import ModuleLock
from .rng import abandon_generators
from .step import StepContext, StepRun
from ..params.weights import HostGradBuffers, LayerTable, has_grad_hooks
from .listener import NO_LISTENER, EngineListener


log = logging.getLogger("lightning_roundpipe")
UNREAD_CALLS_KEPT = 16  # calls whose task times may still be read (several calls per step before backward)


class PipelineEngine:
    """Runs ``layers`` as a RoundPipe pipeline over ``pool`` according to ``plan``."""

    def __init__(self, layers: Sequence[nn.Module], pool: WorkerPool, plan: Plan, options: EngineOptions | None = None,
                 *, shadows=None):
        self.layers = list(layers)
        self.options = (options or EngineOptions()).validate()
        self.tables = [LayerTable(layer) for layer in self.layers]
        self.layer_locks = _shared_module_locks(self.layers)
        self.plan = self._checked(plan)
        self.pool = pool.start()
        if self.options.measure_tasks:
            pool.trace.keep_task_times()
        self.schedule = schedule_named(self.options.schedule)  # the dispatch order; its cursor lives in the history
        self.history: WorkerHistory[Completion] = WorkerHistory(len(pool))  # cursor and slots, across steps
        self.listener: EngineListener = NO_LISTENER  # told of the way back (``listen``)
        self._anchor = torch.zeros((), requires_grad=True)
        self.calls = PipelineCalls(self._anchor, self.master_parameters)  # calls still owing weight gradients
        self.step_count = 0
        self.last_run: StepRun | None = None
        self._finished: StepRun | None = None  # the last call whose computes have all run
        self.shadows = shadows  # a ShadowStore: uploads read compute-dtype copies of the masters
        self.grad_buffers = HostGradBuffers()  # .grad tensors reused across steps (no fresh pages per step)
        self.owed_tail: StepRun | None = None  # a call whose backward returned before its tail was done
        self._early_returns = 0  # depth of returning_early()
        self.context = self._context()

    # ------------------------------------------------------------------ plan
    def _checked(self, plan: Plan) -> Plan:
        plan.validate()
        if plan.num_layers != len(self.layers):
            raise PlanError(f"the plan covers {plan.num_layers} layers but the pipelined module has {len(self.layers)}")
        if not self.options.recompute and not plan.same_cuts():
            raise PlanError(
                "recompute='never' keeps each forward stage's graph until its backward, so backward stages must be cut "
                f"exactly like forward stages; got {plan.to_text()}"
            )
        return plan

    def set_plan(self, plan: Plan, microbatches: int | None = None, recompute: bool | None = None) -> None:
        """Run the next calls with ``plan`` (and ``microbatches`` per batch, and whether backward recomputes,
        when given)."""
        before = self.options
        if recompute is not None and recompute != self.options.recompute:
            self.options = dataclasses.replace(self.options, recompute=recompute).validate()
        try:
            plan = self._checked(plan)
        except PlanError:
            self.options = before  # the plan and the options stay as they were
            raise
        if microbatches is not None:
            self.options = dataclasses.replace(self.options, microbatches=microbatches).validate()
        self.plan = plan
        self.context = self._context()

    def _context(self) -> StepContext:
        """What a call needs, for the calls to come (a call keeps the one it started with)."""
        return StepContext(tuple(self.layers), tuple(self.layer_locks), tuple(self.tables), self.pool, self.plan,
                           self.options, self.schedule, self.history, self.grad_buffers, self.weight_gates,
                           self.notify_grads_accumulated, self.shadows)

    def describe(self) -> str:
        """The plan as text, with the number of workers."""
        return self.plan.describe(len(self.pool))

    @property
    def measurements(self) -> list:
        """(stage, kind, seconds) of the last finished call, for the cost profile (``StepRun.measurements``)."""
        return [] if self._finished is None else self._finished.measurements

    def listen(self, listener: EngineListener) -> None:
        """Report the way back (uploads' waits, gradients on the host, backward done) to ``listener``,
        the one object above the engine (the runtime); it replaces the previous one."""
        self.listener = listener

    def weight_gates(self, layer_ids) -> list[Completion]:
        """Completions an upload of these layers must wait for (new weight versions): the listener's."""
        return self.listener.upload_waits_for(layer_ids)

    def notify_grads_accumulated(self, layer_ids) -> None:
        """The host ``.grad`` of these layers holds this call's gradients: tell the listener."""
        self.listener.on_grads_ready(layer_ids)

    def autocast_state(self) -> dict:
        """Per device type of the workers: (enabled, dtype) of the caller's autocast."""
        state = {}
        for dev in {w.device.type for w in self.pool.workers}:
            if torch.is_autocast_enabled(dev):
                state[dev] = (True, torch.get_autocast_dtype(dev))
        return state

    def master_parameters(self) -> list:
        """The host parameters of every layer, in layer order (a tied one once per layer holding it)."""
        return [t for table in self.tables for t, p in zip(table.tensors, table.is_param) if p]

    def trainable(self) -> bool:
        """Whether any pipelined parameter requires a gradient."""
        return any(t.requires_grad for t in self.master_parameters())

    # ------------------------------------------------------------------ entry points
    def __call__(self, inputs: Any, loss_scale: float | None = None) -> Any:
        """Pipelined forward of one batch.

        With ``loss_scale`` set, the last layer must return a dict with a 0-dim "loss_sum" per
        microbatch, and the call returns ``sum(loss_sum) * loss_scale`` as one scalar (the fused
        last stage runs forward, loss and backward together when the plan says so).
        """
        tensor_inputs = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
        input_requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensor_inputs)
        training = torch.is_grad_enabled() and (input_requires_grad or self.trainable())
        microbatches = split_microbatches(inputs, self.options.microbatches)
        self.step_count += 1
        self.pool.trace.step = self.step_count
        if not self.pool.trace.enabled:
            # A training call whose backward never ran leaves its task times unread.
            self.pool.trace.discard_before(self.step_count - UNREAD_CALLS_KEPT)
        if not training:
            self.finish_backward()  # an owed tail first: evaluation overlaps nothing
        run = StepRun(self.context, microbatches, step=self.step_count, autocast=self.autocast_state(),
                      training=training, loss_scale=loss_scale, input_requires_grad=input_requires_grad)
        self.last_run = run
        if not training:
            with torch.no_grad():
                outs = self._guarded(run.forward)
            self._call_finished(run)
            return self._finish_outputs(run, outs)
        self.calls.started(run)
        out = _PipelineFunction.apply(self, run, self._anchor, *tensor_inputs)
        if loss_scale is not None:
            return out[0]
        return pytree.tree_unflatten(list(out), run.output_spec)

    # ------------------------------------------------------------------ backward that returns early
    @contextlib.contextmanager
    def returning_early(self):
        """Backwards run inside may return before their weight-gradient tail is done (``may_return_early``).

        For a caller that knows nothing reads the weights' ``.grad`` (nor a parameter hook runs)
        before its next engine call, ``finish_backward`` or optimizer step: Lightning's
        accumulation-only backwards (``lightning/strategy.py``)."""
        self._early_returns += 1
        try:
            yield
        finally:
            self._early_returns -= 1

    def may_return_early(self, run: StepRun) -> bool:
        """Whether this backward of ``run`` (one that adds weight gradients) may leave its tail owed:
        inside ``returning_early``, no pipelined input wants a gradient (autograd would read it at
        once; the anchor's gradient is always None), and no pipelined parameter has a tensor hook
        (hooks run as the tail adds each stage's gradients, and may expect to run inside backward)."""
        if not self._early_returns or run.input_requires_grad:
            return False
        return not any(has_grad_hooks(p) for p in self.master_parameters() if p.requires_grad)

    def finish_backward(self) -> None:
        """Finish the backward tail still owed, if any: its weight gradients into ``.grad`` (in
        dispatch order, as a backward that waits adds them) and the listener's backward-done report. A failure of
        the tail raises here, the error a waiting backward would have raised. Every engine entry
        calls this (a training forward right after submitting its own tasks)."""
        run = self.owed_tail
        if run is None:
            return
        self.owed_tail = None
        try:
            self._guarded(run.finish_backward)
        finally:
            self.calls.finished(run)
        self._backward_done(run)

    def _backward_done(self, run: StepRun) -> None:
        self._call_finished(run)
        self.listener.on_backward_done(run)

    def _call_finished(self, run: StepRun) -> None:
        """Every compute of ``run`` has run: its measurements are the engine's latest."""
        run.measurements  # read now: the trace drops the call's records once read
        self._finished = run

    def _finish_outputs(self, run: StepRun, outs: list[HostCarry]):
        trees = [o.tree() for o in outs]
        if run.loss_scale is not None:
            total = torch.zeros((), dtype=torch.float32)
            for t in trees:
                total = total + t["loss_sum"].float()
            return total * run.loss_scale
        return run.outputs.merged(trees)  # filled while the forward ran (OutputAssembly)

    def _guarded(self, fn, *args):
        """Run a host-side phase; on failure let every queued task finish or fail before re-raising.

        The host thread runs it on one intra-op thread (``HOST_PHASE_THREADS``): the workers
        compute meanwhile; the caller's own count is back for its loss and optimizer."""
        try:
            with intra_op_threads(HOST_PHASE_THREADS):
                return fn(*args)
        except BaseException as exc:
            if isinstance(exc, WorkerError):
                # Failed tasks fail their dependants at once, so the queues empty quickly.
                try:
                    self.pool.drain()
                except Exception:
                    self.pool.cancel_pending(exc)
            else:
                self.pool.cancel_pending(exc)
                if not isinstance(exc, (PipelineTimeout, KeyboardInterrupt)):
                    # Any other error (a task's own PipelineError, a host-side one): the tasks still
                    # running end before it reaches the caller, so no lane outlives the step. A lane left
                    # inside a layer's compile would rewind torch's CPU generator when dynamo restores
                    # it, later, under whatever runs then (issue 42). A timeout or an interrupt: do not
                    # wait that long again.
                    try:
                        self.pool.drain()
                    except Exception:  # noqa: BLE001 - the original error is the one to raise
                        pass
            run = getattr(fn, "__self__", None)
            if isinstance(run, StepRun):
                run.drop_device_values()  # what failed readers never read would stay on the device
            raise

    def close(self) -> None:
        """Shut the worker pool down and let go of what its lanes hold of the random generators."""
        self.owed_tail = None  # an owed tail left unfinished is dropped (its gradients are not needed)
        self.pool.shutdown()
        # A lane still inside a layer (after a timeout) keeps running until that layer returns;
        # what it holds of a generator (the CPU one, a GPU's) must not make the next call wait for it.
        abandoned = abandon_generators(self.pool)
        if abandoned:
            log.warning("gave up the generator holds of tasks still running after the pool stopped: %s",
                        "; ".join(abandoned))


def _shared_module_locks(layers: Sequence[nn.Module]) -> list:
    """A lock per layer, shared by layers that share a module object (the same module used twice).

    ``functional_call`` swaps a module's tensors for the call's duration, so one module object
    must never run on two workers at once: not when a module appears in two layers, and not when
    two calls overlap (a fused run's eager backward still recomputing a layer while the next call
    runs it). Distinct modules that merely share a Parameter (tied weights) need no common lock.
    """
    owners: dict[int, int] = {}
    parent = list(range(len(layers)))

    def root(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for i, layer in enumerate(layers):
        for m in layer.modules():
            if id(m) in owners:
                parent[root(i)] = root(owners[id(m)])
            else:
                owners[id(m)] = i
    groups: dict[int, list[int]] = collections.defaultdict(list)
    for i in range(len(layers)):
        groups[root(i)].append(i)
    locks: list = [None] * len(layers)
    for members in groups.values():
        lock = ModuleLock(members)
        for i in members:
            locks[i] = lock
    return locks


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """The calling thread runs with ``n`` intra-op threads inside the block and with its own
    count again after it (also when the block raises): the host's pipelined phases run on
    ``HOST_PHASE_THREADS`` while the workers compute (``host/threads.py``)."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(max(1, int(n)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _PipelineFunction(torch.autograd.Function):
    """Autograd node of a pipelined forward: its backward dispatches the backward stages."""

    @staticmethod
    def forward(ctx, engine: PipelineEngine, run: StepRun, anchor, *tensor_inputs):
        ctx.engine, ctx.run = engine, run
        if run.fused:
            engine._guarded(run.forward, engine.finish_backward)
            loss = engine._guarded(run.fused_loss)
            run.record_outputs(None, [True], [])
            return (loss,)
        outs = engine._guarded(run.forward, engine.finish_backward)
        merged = engine._finish_outputs(run, outs)
        leaves, spec = pytree.tree_flatten(merged)
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            raise TypeError("a pipelined module under autograd must return tensors only (a tensor, tuple or dict of tensors)")
        run.record_outputs(spec, [x.is_floating_point() for x in leaves], [o.tree() for o in outs])
        ctx.mark_non_differentiable(*[x for x in leaves if not x.is_floating_point()])
        return tuple(leaves)

    @staticmethod
    def backward(ctx, *grads):
        engine, run = ctx.engine, ctx.run
        engine.finish_backward()  # another call's owed tail first: its gradients go into .grad before this call's
        with engine.calls.backward(run) as weights_wanted:
            early = weights_wanted and engine.may_return_early(run)
            if run.fused:
                g = grads[0]
                engine._guarded(run.submit_backward, None, None if g is None else float(g))
            else:
                engine._guarded(run.submit_backward, _split_output_grads(run, grads))
            input_grads = None if early else engine._guarded(run.finish_backward, weights_wanted)
        n_inputs = len(ctx.needs_input_grad) - 3
        if early:
            engine.calls.started(run)  # still owes the weights its gradients, until finish_backward
            engine.owed_tail = run
            return (None,) * (3 + n_inputs)
        engine._backward_done(run)
        merged_inputs = [None] * n_inputs
        if run.input_requires_grad and input_grads and input_grads[0] is not None:
            merged = merge_microbatches(input_grads)
            leaves = pytree.tree_leaves(merged, is_leaf=lambda x: x is None)
            tensor_leaves = [x for x in leaves if isinstance(x, torch.Tensor) or x is None]
            merged_inputs = (tensor_leaves + [None] * n_inputs)[:n_inputs]
        return (None, None, None, *merged_inputs)


def _split_output_grads(run: StepRun, grads) -> list[HostCarry]:
    """Split the merged output's gradients back into per-microbatch carries (aligned with outputs)."""
    if run.loss_scale is not None:
        # The output was sum(loss_sum) * loss_scale: every microbatch's loss_sum gets g * loss_scale.
        g = grads[0]
        out = []
        for tree in run.output_sizes:
            leaves, spec = pytree.tree_flatten(tree)
            marked = pytree.tree_leaves({k: pytree.tree_map(lambda _, k=k: k == "loss_sum", v) for k, v in tree.items()})
            out.append(HostCarry([None if g is None or not is_loss else (g * run.loss_scale).to(x.dtype)
                                  for x, is_loss in zip(leaves, marked)], spec))
        return out
    per_mb_trees = run.output_sizes
    sizes = []
    for tree in per_mb_trees:
        leaves = pytree.tree_leaves(tree)
        sizes.append([x.shape[0] for x in leaves])
    out = []
    offsets = [0] * len(grads)
    for m, tree in enumerate(per_mb_trees):
        leaves, spec = pytree.tree_flatten(tree)
        g_leaves = []
        for j, g in enumerate(grads):
            n = sizes[m][j]
            if g is None or not run.output_is_float[j]:
                g_leaves.append(None)
            else:
                g_leaves.append(g.narrow(0, offsets[j], n).contiguous())
            offsets[j] += n
        out.append(HostCarry(g_leaves, spec))
    return out


# ---------------------------------------------------------------------------- calls owing weight gradients
# A step may call the pipelined module more than once and run backward more than once
# (``torch.autograd.grad`` before ``loss.backward()``); the overlapped optimizer may step a layer early
# only once every contribution to its gradient has arrived: which training calls are pending, whether
# a backward adds weight gradients (it runs the engine's anchor leaf's accumulator) and which
# pipelined parameters it also reaches outside the pipeline. The rules: docs/design.md, design notes.


def grad_accumulator(leaf: torch.Tensor):
    """The AccumulateGrad node of a leaf that requires grad (created if no graph holds one yet)."""
    with torch.enable_grad():
        return leaf.view_as(leaf).grad_fn.next_functions[0][0]


class PipelineCalls:
    """The training calls of an engine whose weight backward has not run yet."""

    def __init__(self, anchor: torch.Tensor, parameters):
        self._anchor_node = grad_accumulator(anchor)  # kept: autograd holds its nodes only weakly
        self._parameters = parameters  # callable: the pipelined host parameters
        self._pending: weakref.WeakSet = weakref.WeakSet()
        self.current = None  # the call whose weight backward is running
        self.reached_outside: set[int] = set()  # ids of parameters this backward reaches outside the pipeline

    def started(self, run) -> None:
        """Record a pipelined call whose backward is still to come."""
        self._pending.add(run)

    def finished(self, run) -> None:
        """``run`` added its weight gradients (an owed backward tail finished, or failed)."""
        self._pending.discard(run)

    def others_pending(self) -> bool:
        """True while a call other than the one in backward has not added its weight gradients."""
        return any(r is not self.current for r in list(self._pending))

    @contextlib.contextmanager
    def backward(self, run):
        """Around one backward of ``run``: yields whether this backward adds weight gradients."""
        if torch.is_grad_enabled():
            raise PipelineError(
                "backward through the pipelined module with create_graph=True (double backward, e.g. a gradient "
                "penalty differentiated again) is not supported: the pipeline's backward is not differentiable. "
                "Compute the penalty outside the pipelined module, or train with the default strategy")
        wants_weights = bool(torch._C._will_engine_execute_node(self._anchor_node))
        if not wants_weights:
            yield False
            return
        self.reached_outside = {id(p) for p in self._parameters() if p.requires_grad
                                and torch._C._will_engine_execute_node(grad_accumulator(p))}
        self.current = run
        try:
            yield True
        finally:
            self._pending.discard(run)
            self.current = None
            self.reached_outside = set()
