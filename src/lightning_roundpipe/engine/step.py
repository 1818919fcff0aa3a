"""One pipelined step: the forward stages, then (when asked) the backward stages, over a pool.

This file is the ordering logic, the same for every backend. For each stage the dispatcher
takes the next worker (round-robin, continuing across steps); per microbatch the worker
uploads that microbatch's input as soon as it is on the host, computes, and downloads what the
next stage (and the recompute in backward) needs. Everything is expressed as tasks with
completion dependencies; the host thread only waits for the results it hands back.

Memory bound: a worker's upload of its n-th stage waits for the release of its (n-1-depth)-th
stage, so with prefetch depth 1 a worker holds at most the stage it runs and the one it
prefetches. The compute lane runs in submission order, so a stage's gradient accumulates over
microbatches 0..M-1 in that order, and the host adds stage gradients in dispatch order.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call
from torch.utils import _pytree as pytree

from ..schedule.plan import Stage
from ..workers.completions import Completion, TaskLabel
from .buffers import buffer_writes
from .rng import CallRng
from .stage_inputs import differentiable_inputs, kept_copy
from ..params.weights import StageWeights, accumulate_host_grads

if TYPE_CHECKING:
    from .engine import PipelineEngine


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


def _is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


class StepRun:
    """State of one forward (+ backward) call: host activations, gradients, stashes."""

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
        self.fused = training and loss_scale is not None and self.plan.fused_last
        self.loss_scale = loss_scale
        self.input_requires_grad = input_requires_grad
        self.autocast = engine._autocast_state()
        self.rng = CallRng()  # a seed per (layer, microbatch): recompute draws what forward drew
        self.step = engine.step_count
        # (layer boundary, microbatch) -> Completion whose value is a HostCarry
        self.acts: dict[tuple[int, int], Completion] = {}
        self.grads: dict[tuple[int, int], Completion] = {}
        self.graphs: dict[tuple[int, int], tuple[list, list]] = {}
        self.fwd_weights: dict[int, StageWeights] = {}
        self.fused_stash: dict[str, Any] = {}
        self.eager_work: list = []  # fused runs: backward stages dispatched right after the last stage
        self.loss_parts: list[Completion] = []
        self.wgrad_downloads: list[tuple[StageWeights, Completion]] = []
        self.measurements: list[tuple[Stage, str, float]] = []
        self.stage_order: dict[str, int] = {}  # dispatch serial of each stage, for transfer priorities

    # ------------------------------------------------------------------ helpers
    def _prio(self, kind: str, stage: Stage, queue: str) -> int:
        """Transfer priority (lower first).

        Uploads: stage first, then kind: everything the running stage needs (its weights and its
        microbatch inputs, inputs first) goes before anything of a later stage, and a prefetch of
        the next stage fills the gaps while the running stage waits for its inputs. Downloads: kind
        first, then stage: activations and input gradients that another worker waits for go before
        weight gradients, which only the host needs.
        """
        kind_rank = int(self.opts.priorities[kind])
        order = self.stage_order.get(stage.name, 0)
        return order * 16 + kind_rank if queue == "upload" else kind_rank * (1 << 40) + order

    def _timeout(self) -> float:
        return self.pool.timeout_s

    def _wait(self, c: Completion) -> Any:
        return c.wait(self._timeout(), waiter="the host thread", diagnose=self.pool.diagnose)

    def _label(self, kind: str, stage: Stage | None, mb: int, worker, queue: str) -> TaskLabel:
        return TaskLabel(kind, stage.name if stage is not None else "", mb, worker.index, queue)

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
            lock = self.engine.layer_locks[l] or contextlib.nullcontext()
            with lock, self.rng.layer(device, l, mb), buffer_writes(weights, l, layers[l], self.M, keep=not recompute):
                carry = functional_call(layers[l], weights.params_for(l), (carry,))
            if l + 1 in save_at:
                saved[l + 1] = kept_copy(carry)  # the next layer may write it in place
        saved[end] = carry
        return saved

    def _upload_weights(self, worker, stage: Stage, need_grads: bool) -> tuple[StageWeights, list[Completion]]:
        eng = self.engine
        weights = StageWeights(eng.tables, stage.layers, self.opts.compute_dtype, self.opts.chunk_bytes, need_grads,
                               eng.shadows)
        deps = [eng._slot_dependency(worker.index)] + eng.weight_gates(stage.layers)
        done = []
        for k, chunk in enumerate(weights.chunks):
            def fn(chunk=chunk):
                # Parameters are only read; buffers may be written in forward (BatchNorm statistics)
                # and must not reach the host that way.
                dev = self.pool._copy_to_device(worker, [weights.sources[i] for i in chunk], [weights.dtypes[i] for i in chunk],
                                                read_only=[weights.is_param[i] for i in chunk])
                weights.store_chunk(chunk, dev)
                worker.track_weights(weights.chunk_bytes(chunk))
                return None

            done.append(
                worker.submit("upload", fn, deps, self._label("weights", stage, -1, worker, "upload"),
                              priority=self._prio("weights", stage, "upload"), nbytes=weights.chunk_bytes(chunk))
            )
        return weights, done

    def _release(self, worker, weights: StageWeights, deps, stage: Stage) -> None:
        def fn():
            weights.release()
            worker.track_weights(-weights.nbytes)

        # On the download lane, not the in-order compute lane: the worker's next stage must not
        # wait behind this stage's gradient download just to free memory.
        c = worker.submit("download", fn, deps, self._label("release", stage, -1, worker, "download"), priority=-1,
                          always=True)
        self.engine._record_release(worker.index, c)

    def _upload_carry(self, worker, src: Completion, kind: str, stage: Stage, mb: int) -> Completion:
        def fn():
            host: HostCarry = src.value
            idx = [i for i, x in enumerate(host.leaves) if isinstance(x, torch.Tensor)]
            dev = self.pool._copy_to_device(worker, [host.leaves[i] for i in idx], [None] * len(idx))
            leaves = list(host.leaves)
            for i, d in zip(idx, dev):
                leaves[i] = d
            return HostCarry(leaves, host.spec)

        nbytes = _carry_bytes(src.value) if src.is_set() and src.value is not None else 0
        # At most two microbatch inputs ahead of the compute queue: bounded activation memory.
        deps = [src, self.engine._input_slot(worker.index)]
        return worker.submit("upload", fn, deps, self._label(kind, stage, mb, worker, "upload"),
                             priority=self._prio("activation", stage, "upload"), nbytes=nbytes)

    def _download_carry(self, worker, get_tree, dep: Completion, kind: str, stage: Stage, mb: int) -> Completion:
        def fn():
            host = get_tree()
            idx = [i for i, x in enumerate(host.leaves) if isinstance(x, torch.Tensor)]
            out = self.pool._copy_to_host(worker, [host.leaves[i] for i in idx])
            leaves = list(host.leaves)
            for i, h in zip(idx, out):
                leaves[i] = h
            return HostCarry(leaves, host.spec)

        return worker.submit("download", fn, [dep], self._label(kind, stage, mb, worker, "download"),
                             priority=self._prio("activation", stage, "download"))

    def _timed(self, stage: Stage, kind: str, fn):
        def run():
            t0 = time.perf_counter()
            out = fn()
            self.measurements.append((stage, kind, time.perf_counter() - t0))
            return out

        return run

    # ------------------------------------------------------------------ forward
    def forward(self) -> list[HostCarry]:
        """Dispatch every forward stage; return each microbatch's output carry (host)."""
        eng = self.engine
        for i, mb in enumerate(self.mbs):
            self.acts[(0, i)] = Completion.done(TaskLabel("input", "", i), HostCarry.of(mb))
        saved_bounds = set(self.plan.saved_boundaries()) if (self.training and not self.keep_graph) else set()
        fwd = self.plan.forward_stages()
        for k, stage in enumerate(fwd):
            worker = eng._next_worker_for()
            self.stage_order[stage.name] = eng._next_stage_serial()
            is_fused = self.fused and k == len(fwd) - 1
            need_grads = self.keep_graph or is_fused
            weights, ready = self._upload_weights(worker, stage, need_grads)
            last = None
            for i in range(self.M):
                act_in = self._upload_carry(worker, self.acts[(stage.start, i)], "act_in", stage, i)
                if is_fused:
                    last = self._fused_microbatch(worker, weights, stage, i, ready, act_in)
                    continue
                save_at = {b for b in saved_bounds if stage.start < b < stage.end}
                comp = worker.compute(
                    self._timed(stage, "forward", self._forward_fn(worker, weights, stage, i, act_in, save_at)),
                    ready + [act_in], self._label("forward", stage, i, worker, "compute"))
                eng._record_compute(worker.index, comp)
                last = comp
                for b in sorted(save_at | {stage.end}):
                    self.acts[(b, i)] = self._download_carry(
                        worker, (lambda comp=comp, b=b: HostCarry.of(comp.value[b])), comp, "act_out", stage, i)
            if is_fused:
                wg = worker.download(lambda w=weights: w.device_grads(), [last],
                                     self._label("wgrad", stage, -1, worker, "download"),
                                     priority=self._prio("gradients", stage, "download"), nbytes=weights.grad_bytes)
                self.fused_stash["wgrad"] = (weights, wg)
                self._release(worker, weights, [wg], stage)
            elif self.keep_graph:
                self.fwd_weights[k] = weights  # the kept graph holds them until backward
                self.fwd_weights[k]._worker = worker
            else:
                self._release(worker, weights, [last], stage)
        if self.fused:
            self.eager_work = self._dispatch_backward()
            return []
        L = self.plan.num_layers
        outs = [self._wait(self.acts[(L, i)]) for i in range(self.M)]
        self.rng.finish_forward()
        return outs

    def _forward_fn(self, worker, weights, stage, i, act_in, save_at):
        def fn():
            carry = act_in.value
            if self.keep_graph:
                tree = carry.tree()
                in_leaves = _leaves_requiring_grad(tree, need=stage.start > 0 or self.input_requires_grad)
                with self._compute_context(worker.device, grad=True):
                    out = self._run_layers(worker.device, weights, stage.start, stage.end, in_leaves[1], i)
                self.graphs[(stage.index, i)] = (in_leaves[0], carry.spec, pytree.tree_leaves(out[stage.end]))
                return {stage.end: pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out[stage.end])}
            with self._compute_context(worker.device, grad=False):
                return self._run_layers(worker.device, weights, stage.start, stage.end, carry.tree(), i, save_at)
        return fn

    def _fused_microbatch(self, worker, weights, stage, i, ready, act_in) -> Completion:
        """Forward, loss and backward of the last stage at once; only the scalar and gradients come home."""
        def fn():
            tree = act_in.value.tree()
            in_leaves, tree = _leaves_requiring_grad(tree, need=stage.start > 0 or self.input_requires_grad)
            with self._compute_context(worker.device, grad=True):
                out = self._run_layers(worker.device, weights, stage.start, stage.end, tree, i)[stage.end]
                loss_sum = out["loss_sum"]
                (loss_sum.float() * self.loss_scale).backward()
            grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in in_leaves]
            return loss_sum.detach().float(), HostCarry(grads, act_in.value.spec)

        comp = worker.compute(self._timed(stage, "fused", fn), ready + [act_in],
                              self._label("fused", stage, i, worker, "compute"))
        self.engine._record_compute(worker.index, comp)
        self.loss_parts.append(worker.download(lambda: [comp.value[0]], [comp],
                                               self._label("loss", stage, i, worker, "download"),
                                               priority=self._prio("activation", stage, "download")))
        self.grads[(stage.start, i)] = self._download_carry(
            worker, lambda: comp.value[1], comp, "grad_out", stage, i)
        return comp

    def fused_loss(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32)
        for c in self.loss_parts:  # fixed order: microbatch 0..M-1
            total = total + self._wait(c)[0]
        self.rng.finish_forward()
        return total * self.loss_scale

    # ------------------------------------------------------------------ backward
    def backward(self, output_grads: list[HostCarry | None], incoming_scale: float | None = None,
                 accumulate: bool = True) -> list[list | None]:
        """Add every stage's weight gradients to the host ``.grad`` (dispatch order); return input grads.

        ``accumulate=False`` (``torch.autograd.grad`` for the inputs only): leave ``.grad`` alone.

        Ordinary runs dispatch the backward stages now. A fused run dispatched them already, right
        after its last stage (backward is linear in the loss's gradient, so it ran for a gradient
        of 1 while the host went on): here its results are only multiplied by ``incoming_scale``.
        """
        eng = self.engine
        if self.fused:
            weights, wg = self.fused_stash["wgrad"]
            host_work = [(weights, wg)] + self.eager_work
            scale = incoming_scale
        else:
            for i in range(self.M):
                self.grads[(self.plan.num_layers, i)] = Completion.done(TaskLabel("grad_output", "", i), output_grads[i])
            host_work = self._dispatch_backward()
            scale = None
        # Host side: gradients into .grad in dispatch order (deterministic whatever the timing).
        for weights, wg in host_work:
            grads = self._wait(wg)
            if accumulate:
                accumulate_host_grads(weights, grads, scale)
                eng._on_grads_accumulated(weights.layer_ids)
        if not self.input_requires_grad:
            return [None] * self.M
        trees = [self._wait(self.grads[(0, i)]) for i in range(self.M)]
        if scale is not None and scale != 1.0:
            trees = [HostCarry([x * scale if isinstance(x, torch.Tensor) else x for x in t.leaves], t.spec) for t in trees]
        return [t.tree() for t in trees]

    def _dispatch_backward(self) -> list[tuple[StageWeights, Completion]]:
        """Submit the backward stages (the fused one excepted) in reverse; return their gradient downloads."""
        eng = self.engine
        host_work = []
        stages = list(reversed(self.plan.backward_stages()))
        if self.fused:
            stages = stages[1:]  # its backward already ran, fused with its forward
        for stage in stages:
            worker = eng._next_worker_for()
            self.stage_order[stage.name] = eng._next_stage_serial()
            if self.keep_graph:
                weights = self.fwd_weights[stage.index]
                ready = []
            else:
                weights, ready = self._upload_weights(worker, stage, need_grads=True)
            last = None
            for i in range(self.M):
                g_in = self._upload_carry(worker, self.grads[(stage.end, i)], "grad_in", stage, i)
                deps = ready + [g_in]
                a_in = None
                if not self.keep_graph:
                    a_in = self._upload_carry(worker, self.acts[(stage.start, i)], "act_in", stage, i)
                    deps.append(a_in)
                comp = worker.compute(self._backward_fn(worker, weights, stage, i, a_in, g_in),
                                      deps, self._label("backward", stage, i, worker, "compute"))
                eng._record_compute(worker.index, comp)
                last = comp
                if stage.start > 0 or self.input_requires_grad:
                    self.grads[(stage.start, i)] = self._download_carry(
                        worker, (lambda comp=comp: comp.value), comp, "grad_out", stage, i)
            wg = worker.download(lambda w=weights: w.device_grads(), [last],
                                 self._label("wgrad", stage, -1, worker, "download"),
                                 priority=self._prio("gradients", stage, "download"), nbytes=weights.grad_bytes)
            host_work.append((weights, wg))
            if self.keep_graph:
                self._release_kept(weights, wg, stage)
            else:
                self._release(worker, weights, [wg], stage)
        return host_work

    def _release_kept(self, weights, wg, stage):
        worker = weights._worker

        def fn():
            weights.release()
            worker.track_weights(-weights.nbytes)

        worker.submit("download", fn, [wg], self._label("release", stage, -1, worker, "download"), priority=-1,
                      always=True)

    def _backward_fn(self, worker, weights, stage, i, a_in, g_in):
        def fn():
            g_leaves = g_in.value.leaves
            if self.keep_graph:
                in_leaves, spec, out_leaves = self.graphs.pop((stage.index, i))
            else:
                spec = a_in.value.spec
                tree = a_in.value.tree()
                in_leaves, tree = _leaves_requiring_grad(tree, need=stage.start > 0 or self.input_requires_grad)
                t0 = time.perf_counter()
                with self._compute_context(worker.device, grad=True):
                    out = self._run_layers(worker.device, weights, stage.start, stage.end, tree, i,
                                           recompute=True)[stage.end]
                self.measurements.append((stage, "recompute", time.perf_counter() - t0))
                out_leaves = pytree.tree_leaves(out)
            t0 = time.perf_counter()
            pairs = [(o, g) for o, g in zip(out_leaves, g_leaves)
                     if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
            grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in in_leaves]
            self.measurements.append((stage, "backward", time.perf_counter() - t0))
            return HostCarry(grads, spec)
        return fn


def _leaves_requiring_grad(tree, need: bool):
    """(leaves requiring grad, the tree the layers get: copies, safe to write in place); see stage_inputs.py."""
    return differentiable_inputs(tree, need)


def _carry_bytes(host: HostCarry) -> int:
    return sum(x.numel() * x.element_size() for x in host.leaves if isinstance(x, torch.Tensor))
