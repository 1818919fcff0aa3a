"""Memory a RoundPipe plan needs: per worker (GPU) and on the host.

GPU, per worker: the two largest consecutive tasks' weights and gradients (a worker holds the
stage it runs and the one it prefetches; a stage's gradient buffer lives until its gradients
are home), plus one microbatch's activation working set: the autograd graph of the running stage
(stage-level recompute keeps the whole stage's graph; a forward keeps none, only one layer's
intermediates) and two input and two output buffers (double buffering). The simulator's peak
never exceeds this bound (tested). With layer-grain recompute (``recompute="layer"``) a
backward or fused stage holds one layer's graph at a time plus the inputs of its layers after
the first (the first is the input buffer): ``max_l graph(l) + sum_{a < c < b} in(c)``.

Host: fp32 master weights, fp32 gradients and two fp32 Adam moments (16 bytes) per trainable
parameter, the compute-dtype copy of every parameter that uploads read from (frozen LoRA bases
live only in that copy), the host buffers the weight gradients are downloaded into (compute
dtype, every trainable parameter: a fused last stage keeps a step's gradient downloads until its
call is gone), and the stage-boundary activations the forward saves for recompute (every
microbatch, every backward stage start).

Pinned: under a pinned policy ("alloc", "register") the upload copy, the gradient download
buffers and the saved activations are page-locked (the stream pools pin exactly those, at their
exact size). Page-locked memory cannot be swapped out, so it is reported as its own figure: the
host must hold it in RAM, whatever else it pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from .profile import CostProfile
from ..schedule.plan import Plan, Stage, dispatch
from .view import CostView

FP32_STATE_BYTES_PER_TRAINABLE = 16  # master weight, gradient, Adam m and v, all fp32


def _is_backward(plan: Plan, stage: Stage) -> bool:
    return stage.direction == "B" or (plan.fused_last and stage.direction == "F" and stage.index == len(plan.forward) - 1)


def stage_state_bytes(plan: Plan, view: CostView, stage: Stage) -> int:
    """Weights plus (for backward and fused stages) the gradient buffer of one stage."""
    grads = view.grads(stage.start, stage.end) if _is_backward(plan, stage) else 0
    return view.weights(stage.start, stage.end) + grads


RECOMPUTE_GRAINS = ("stage", "layer")


def layer_grain_graph(view: CostView, a: int, b: int) -> int:
    """Working set of a stage ``[a, b)`` recomputed one layer at a time: the largest layer's graph
    plus the kept inputs of layers ``a+1 .. b-1`` (an upper bound: while layer l is recomputed
    only the inputs up to l are still kept)."""
    return view.max_layer_graph(a, b) + sum(view.in_bytes(c) for c in range(a + 1, b))


def stage_activation_bytes(plan: Plan, view: CostView, stage: Stage, recompute: str = "stage") -> tuple[int, int, int]:
    """(graph, input buffer, output buffer) bytes of one microbatch of ``stage``.

    ``recompute``: "stage" (a backward stage keeps its whole graph) or "layer" (one layer's graph
    and the stage's layer inputs, :func:`layer_grain_graph`)."""
    if recompute not in RECOMPUTE_GRAINS:
        raise ValueError(f"recompute grain must be one of {RECOMPUTE_GRAINS}, got {recompute!r}")
    a, b = stage.start, stage.end
    fused = _is_backward(plan, stage) and stage.direction == "F"
    if recompute == "layer" and _is_backward(plan, stage):
        graph = layer_grain_graph(view, a, b)
    else:
        graph = view.stage_graph("forward" if stage.direction == "F" and not fused else "backward", a, b)
    if stage.direction == "F" and not fused:
        inputs = view.in_bytes(a)
        outputs = view.out_bytes(b - 1) + sum(view.in_bytes(c) for c in plan.saved_boundaries() if a < c < b)
    else:
        inputs = view.in_bytes(a) + (view.out_bytes(b - 1) if stage.direction == "B" else 0)
        outputs = view.in_bytes(a) if a > 0 else 0
    return graph, inputs, outputs


def roundpipe_gpu_bytes(plan: Plan, costs: CostProfile, num_workers: int, continue_round_robin: bool = True,
                        recompute: str = "stage") -> list[int]:
    """Upper bound of each worker's memory while running ``plan`` (see the module docstring);
    ``recompute``: the grain of backward stages, "stage" or "layer"."""
    view = CostView(costs)
    per_worker: list[list[Stage]] = [[] for _ in range(num_workers)]
    first, n_tasks = 0, len(plan.forward) + len(plan.dispatched_backward_stages())
    # Enough steps for the round-robin offset to come back to where it started.
    for _ in range(num_workers if continue_round_robin else 1):
        for task in dispatch(plan, num_workers, first):
            per_worker[task.worker].append(task.stage)
        if continue_round_robin:
            first = (first + n_tasks) % num_workers
    out = []
    for stages in per_worker:
        if not stages:
            out.append(0)
            continue
        states = [stage_state_bytes(plan, view, s) for s in stages]
        cyc = states + states[:1]  # the last task of the cycle is followed by the first of the next
        pair = max(cyc[i] + cyc[i + 1] for i in range(len(cyc) - 1)) if len(states) > 1 else 2 * states[0]
        acts = [stage_activation_bytes(plan, view, s, recompute) for s in stages]
        graph = max(g for g, _, _ in acts)
        buffers = 2 * max(i for _, i, _ in acts) + 2 * max(o for _, _, o in acts)
        out.append(pair + graph + buffers)
    return out


@dataclass
class HostMemory:
    """Host bytes of a training run, by purpose."""

    optimizer_state: int  # fp32 masters, gradients and Adam moments of trainable parameters
    compute_copy: int  # compute-dtype copy of every parameter (uploads read it)
    saved_activations: int  # stage inputs kept for recompute, all microbatches
    gradient_downloads: int = 0  # host buffers the weight gradients land in (compute dtype)
    params: int = 0  # distinct parameters, for the per-parameter figures

    @property
    def total(self) -> int:
        return self.optimizer_state + self.compute_copy + self.saved_activations + self.gradient_downloads

    @property
    def pinned(self) -> int:
        """Bytes page-locked under a pinned policy: what uploads read and downloads land in."""
        return self.compute_copy + self.gradient_downloads + self.saved_activations

    @property
    def pinned_upload_bytes_per_param(self) -> float:
        """Pinned bytes of the upload copy per parameter (2.0 with bf16 shadows, 4.0 in fp32)."""
        return self.compute_copy / self.params if self.params else 0.0


def host_bytes(costs: CostProfile, plan: Plan | None = None, microbatches: int = 1) -> HostMemory:
    """Host memory of training with ``costs``; activations counted when a plan is given."""
    view = CostView(costs)
    acts = 0
    if plan is not None:
        acts = microbatches * sum(view.in_bytes(b) for b in plan.saved_boundaries() if b > 0)
    trainable = view.unique_trainable_params()
    return HostMemory(trainable * FP32_STATE_BYTES_PER_TRAINABLE, view.unique_params() * view.dtype_bytes, acts,
                      gradient_downloads=trainable * view.dtype_bytes, params=view.unique_params())
