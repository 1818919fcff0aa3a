"""The pipeline engine: runs a plan over a worker pool, from plain PyTorch.

``engine(inputs)`` runs the pipelined forward of ``layers`` (a list of modules, each taking the
previous one's output) and returns the merged output. When grad is enabled and something needs
a gradient, the output is attached to a custom autograd Function, so ``loss.backward()`` runs
the pipelined backward and leaves the weight gradients in the host parameters' ``.grad``, as
a plain run would. Knows nothing of Lightning.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..schedule.plan import Plan, PlanError
from ..workers.completions import Completion, WorkerError
from ..workers.pool import WorkerPool
from .microbatch import merge_microbatches, split_microbatches
from .calls import PipelineCalls
from .rng import uses_randomness
from .step import HostCarry, StepRun
from ..params.weights import LayerTable


@dataclass
class EngineOptions:
    """How the engine runs a plan.

    microbatches: number of microbatches a batch is split into (dim 0).
    recompute: True keeps only stage inputs in forward and recomputes in backward (bounded
        memory); False keeps each forward graph until backward (CPU backend only: its workers
        share memory) and needs backward stages cut like forward ones.
    compute_dtype: dtype floating parameters are cast to on upload (None: as stored on host).
    priorities: transfer priorities (lower first) for "activation", "weights", "gradients".
    chunk_bytes: weight uploads are split into chunks of about this size, so higher-priority
        transfers can get in between chunks.
    prefetch_depth: stages a worker may upload ahead of the one it runs (1: at most two resident).
    """

    microbatches: int = 2
    recompute: bool = True
    compute_dtype: torch.dtype | None = None
    priorities: dict = field(default_factory=lambda: {"activation": 0, "weights": 1, "gradients": 2})
    chunk_bytes: int = 32 << 20
    prefetch_depth: int = 1

    def validate(self) -> "EngineOptions":
        if int(self.microbatches) < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if int(self.prefetch_depth) < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if int(self.chunk_bytes) < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        missing = {"activation", "weights", "gradients"} - set(self.priorities)
        if missing:
            raise ValueError(f"priorities must give a number for {sorted(missing)}")
        return self


class PipelineEngine:
    """Runs ``layers`` as a RoundPipe pipeline over ``pool`` according to ``plan``."""

    def __init__(self, layers: Sequence[nn.Module], pool: WorkerPool, plan: Plan, options: EngineOptions | None = None):
        self.layers = list(layers)
        self.options = (options or EngineOptions()).validate()
        self.tables = [LayerTable(layer) for layer in self.layers]
        self.layer_locks = _shared_module_locks(self.layers)
        self.plan = self._checked(plan)
        self.pool = pool.start()
        self._next_worker = 0
        self._stage_serial = 0
        self._releases: dict[int, collections.deque] = {w.index: collections.deque(maxlen=8) for w in pool.workers}
        self._computes: dict[int, collections.deque] = {w.index: collections.deque(maxlen=4) for w in pool.workers}
        self._anchor = torch.zeros((), requires_grad=True)
        self.calls = PipelineCalls(self._anchor, self.master_parameters)  # calls still owing weight gradients
        self.step_count = 0
        self.last_run: StepRun | None = None
        self.measurements: list = []  # (stage, kind, seconds) of the last step, for the cost profile
        self.grad_hooks: list = []  # called with a layer range once its gradients are on the host
        self.step_end_hooks: list = []  # called with the StepRun after each training backward
        self._weight_gate_fn = None
        self.shadows = None  # a ShadowStore: uploads read compute-dtype copies of the masters

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

    def set_plan(self, plan: Plan) -> None:
        self.plan = self._checked(plan)

    def describe(self) -> str:
        return self.plan.describe(len(self.pool))

    # ------------------------------------------------------------------ hooks used by StepRun
    def _next_worker_for(self):
        w = self.pool.workers[self._next_worker % len(self.pool)]
        self._next_worker = (self._next_worker + 1) % len(self.pool)
        return w

    def _next_stage_serial(self) -> int:
        self._stage_serial += 1
        return self._stage_serial

    def _slot_dependency(self, worker_index: int) -> Completion | None:
        history = self._releases[worker_index]
        depth = int(self.options.prefetch_depth)
        if len(history) < depth + 1:
            return None
        dep = history[-(depth + 1)]
        return None if dep.failed() else dep  # a release cancelled with a failed step freed its memory already

    def _input_slot(self, worker_index: int) -> Completion | None:
        """An input upload waits for the compute two places before the one it feeds (double buffering)."""
        history = self._computes[worker_index]
        if len(history) < 2:
            return None
        dep = history[-2]
        return None if dep.failed() else dep

    def _record_compute(self, worker_index: int, completion: Completion) -> None:
        self._computes[worker_index].append(completion)

    def _record_release(self, worker_index: int, completion: Completion) -> None:
        self._releases[worker_index].append(completion)

    def weight_gates(self, layer_ids) -> list[Completion]:
        """Completions an upload of these layers must wait for (new weight versions); none by default."""
        return self._weight_gate_fn(layer_ids) if self._weight_gate_fn is not None else []

    def _on_grads_accumulated(self, layer_ids) -> None:
        for hook in self.grad_hooks:
            hook(layer_ids)

    def layer_uses_rng(self, index: int) -> bool:
        return uses_randomness(self.layers[index])

    def _autocast_state(self) -> dict:
        state = {}
        for dev in {w.device.type for w in self.pool.workers}:
            if torch.is_autocast_enabled(dev):
                state[dev] = (True, torch.get_autocast_dtype(dev))
        return state

    def master_parameters(self) -> list:
        """The host parameters of every layer, in layer order (a tied one once per layer holding it)."""
        return [t for table in self.tables for t, p in zip(table.tensors, table.is_param) if p]

    def trainable(self) -> bool:
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
        run = StepRun(self, microbatches, training=training, loss_scale=loss_scale, input_requires_grad=input_requires_grad)
        self.last_run = run
        if not training:
            with torch.no_grad():
                outs = self._guarded(run.forward)
            self.measurements = run.measurements
            return self._finish_outputs(outs, loss_scale)
        self.calls.started(run)
        out = _PipelineFunction.apply(self, run, self._anchor, *tensor_inputs)
        self.measurements = run.measurements
        if loss_scale is not None:
            return out[0]
        return pytree.tree_unflatten(list(out), run.output_spec)

    def _finish_outputs(self, outs: list[HostCarry], loss_scale):
        trees = [o.tree() for o in outs]
        if loss_scale is not None:
            total = torch.zeros((), dtype=torch.float32)
            for t in trees:
                total = total + t["loss_sum"].float()
            return total * loss_scale
        return merge_microbatches(trees)

    def _guarded(self, fn, *args):
        """Run a host-side phase; on failure let every queued task finish or fail before re-raising."""
        try:
            return fn(*args)
        except BaseException as exc:
            if isinstance(exc, WorkerError):
                # Failed tasks fail their dependants at once, so the queues empty quickly.
                try:
                    self.pool.drain()
                except Exception:
                    self.pool.cancel_pending(exc)
            else:  # a timeout or an interrupt: do not wait that long again
                self.pool.cancel_pending(exc)
            raise

    def close(self) -> None:
        self.pool.shutdown()


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
        lock = threading.Lock()
        for i in members:
            locks[i] = lock
    return locks


class _PipelineFunction(torch.autograd.Function):
    """Autograd node of a pipelined forward: its backward dispatches the backward stages."""

    @staticmethod
    def forward(ctx, engine: PipelineEngine, run: StepRun, anchor, *tensor_inputs):
        ctx.engine, ctx.run = engine, run
        if run.fused:
            engine._guarded(run.forward)
            loss = engine._guarded(run.fused_loss)
            run.output_spec = None
            run.output_is_float = [True]
            return (loss,)
        outs = engine._guarded(run.forward)
        merged = engine._finish_outputs(outs, run.loss_scale)
        leaves, spec = pytree.tree_flatten(merged)
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            raise TypeError("a pipelined module under autograd must return tensors only (a tensor, tuple or dict of tensors)")
        run.output_spec = spec
        run.output_is_float = [x.is_floating_point() for x in leaves]
        run.output_sizes = [o.tree() for o in outs]
        ctx.mark_non_differentiable(*[x for x in leaves if not x.is_floating_point()])
        return tuple(leaves)

    @staticmethod
    def backward(ctx, *grads):
        engine, run = ctx.engine, ctx.run
        with engine.calls.backward(run, run.keep_graph) as weights_wanted:
            if run.fused:
                g = grads[0]
                input_grads = engine._guarded(run.backward, None, None if g is None else float(g), weights_wanted)
            else:
                per_mb = _split_output_grads(run, grads)
                input_grads = engine._guarded(run.backward, per_mb, None, weights_wanted)
        for hook in engine.step_end_hooks:
            hook(run)
        n_inputs = len(ctx.needs_input_grad) - 3
        merged_inputs = [None] * n_inputs
        if run.input_requires_grad and input_grads and input_grads[0] is not None:
            merged = merge_microbatches(input_grads)
            leaves = pytree.tree_leaves(merged, is_leaf=lambda x: x is None)
            tensor_leaves = [x for x in leaves if isinstance(x, torch.Tensor) or x is None]
            merged_inputs = (tensor_leaves + [None] * n_inputs)[:n_inputs]
        return (None, None, None, *merged_inputs)


def _split_output_grads(run: StepRun, grads) -> list[HostCarry]:
    """Split the merged output's gradients back into per-microbatch carries (aligned with outputs)."""
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
