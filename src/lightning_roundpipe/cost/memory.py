"""Memory a RoundPipe plan needs: per worker (GPU) and on the host.

GPU, per worker (``roundpipe_gpu_bytes``): the largest peak of the stages it runs (weights and
gradients with the next stage's prefetch, one microbatch's activations, buffers, transfers in
flight), checked against the CPU backend's measured peaks (``docs/memory.md``). Host: fp32 state
per trainable parameter, the upload copy, gradient download buffers, the undo journal, saved activations, and the
pinned part of them with the ``ulimit -l`` that covers it (``memlock_kib``). The terms:
docs/design.md, design notes, ``cost/memory.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .profile import CostProfile
from ..schedule.dispatch_order import ROUND_ROBIN, Schedule
from ..schedule.plan import Plan, Stage
from .view import CostView

FP32_STATE_BYTES_PER_TRAINABLE = 16  # master weight, gradient, Adam m and v, all fp32
UNDO_BYTES_PER_TRAINABLE = 12  # the failed-step undo's copy: master weight, Adam m and v (optim/step_undo.py)
# The undo journal's default bound (``optimizer_undo_journal_bytes``): before-images of at most this
# many bytes per step; layers past it step once the step is known good (optim/overlap.py).
DEFAULT_UNDO_JOURNAL_BYTES = 4 << 30
DOWNLOAD_POOL_CAP_BYTES = 2 << 30  # free download buffers kept (workers/host_buffers.py DEFAULT_CAP_BYTES; tested equal)


def _is_backward(plan: Plan, stage: Stage) -> bool:
    return stage.direction == "B" or (plan.fused_last and stage.direction == "F" and stage.index == len(plan.forward) - 1)


def stage_state_bytes(plan: Plan, view: CostView, stage: Stage) -> int:
    """Weights plus (for backward and fused stages) the gradient buffer of one stage."""
    grads = view.grads(stage.start, stage.end) if _is_backward(plan, stage) else 0
    return view.weights(stage.start, stage.end) + grads


RECOMPUTE_GRAINS = ("stage", "layer")


def layer_grain_graph(view: CostView, a: int, b: int) -> int:
    """Working set of a stage ``[a, b)`` recomputed one layer at a time: the largest one-layer
    backward working set (its graph, and its gradients while it back-propagates) plus the kept
    inputs of layers ``a+1 .. b-1`` (an upper bound: while layer l is recomputed only the inputs
    up to l are still kept)."""
    return (max(view.backward_working_set(l, l + 1) for l in range(a, b))
            + sum(view.in_bytes(c) for c in range(a + 1, b)))


def stage_activation_bytes(plan: Plan, view: CostView, stage: Stage, recompute: str = "stage") -> tuple[int, int, int]:
    """(working set, inputs, outputs) bytes of one microbatch of ``stage``: the graph (or a forward's
    temporaries), the activation and gradient inputs, and the outputs (a forward's output and the
    boundaries it saves for recompute; a backward's input gradient).

    ``recompute``: "stage" (a backward stage keeps its whole graph) or "layer" (one layer's graph
    and the stage's layer inputs, ``layer_grain_graph``)."""
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
        inputs = view.in_bytes(a) + (view.out_grad_bytes(b - 1) if stage.direction == "B" else 0)
        outputs = view.out_grad_bytes(a - 1) if a > 0 else 0
        # The layers get a copy of each input they differentiate (engine/layer_call.py: they may
        # write it in place; the leaf keeps the gradient), and the first layer keeps that copy.
        graph += outputs
    return graph, inputs, outputs


def worker_stages(plan: Plan, num_workers: int, continue_round_robin: bool = True,
                  schedule: Schedule = ROUND_ROBIN) -> list[list[Stage]]:
    """Each worker's stages in the order it runs them (over ``num_workers`` steps, enough for the
    schedule's cursor to come back to where it started, unless ``continue_round_robin`` is False:
    one step)."""
    per_worker: list[list[Stage]] = [[] for _ in range(num_workers)]
    first, n_tasks = 0, len(plan.forward) + len(plan.dispatched_backward_stages())
    for _ in range(num_workers if continue_round_robin else 1):
        for task in schedule.dispatch(plan, num_workers, first):
            per_worker[task.worker].append(task.stage)
        first = schedule.cursor_after(first, n_tasks, num_workers)
    return per_worker


def _phase(plan: Plan, stage: Stage) -> str:
    """The call that submits ``stage``'s tasks: the forward, or the backward (which a fused last stage
    runs inside the forward)."""
    return "forward" if stage.direction == "F" or plan.fused_last else "backward"


def _inputs_ahead(plan: Plan, view: CostView, stage: Stage) -> int:
    """Bytes of a microbatch's inputs uploaded while the microbatch before it computes.

    Its activation input, when it waits on the host (layer 0's, or a backward stage's saved
    boundary) or comes from a forward stage that computes a microbatch no slower than this stage
    reaches its peak; the gradient of the last layer's output, when the caller computed it. A
    gradient another backward stage computes arrives in step with this stage.
    """
    a, b = stage.start, stage.end
    if stage.direction == "B":
        return view.in_bytes(a) + (view.out_grad_bytes(b - 1) if b == plan.num_layers else 0)
    if stage.index == 0:
        return view.in_bytes(a)
    source = plan.forward_stages()[stage.index - 1]
    faster = view.forward_s(source.start, source.end) <= _seconds_to_peak(plan, view, stage)
    return view.in_bytes(a) if faster else 0


def _seconds_to_peak(plan: Plan, view: CostView, stage: Stage) -> float:
    """Time from a microbatch's compute start to its memory peak: the end of the forward part
    (a backward's recompute, a fused stage's forward and loss; all of a forward stage)."""
    return view.forward_s(stage.start, stage.end)


def stage_peak_bytes(plan: Plan, view: CostView, stages: list[Stage], k: int,
                     link_bytes_per_second: float | None, microbatches: int | None = None,
                     recompute: str = "stage") -> int:
    """A worker's bytes at the peak of a microbatch of ``stages[k]`` (its tasks run cyclically).

    Always there: the stage's weights (and its gradients, which accumulate over its
    microbatches), its working set (``CostView.stage_graph``), this microbatch's inputs, the
    next microbatch's inputs uploaded ahead (after the last microbatch, the next stage's;
    ``_inputs_ahead``) and, for a forward stage, its outputs.

    What may still be in flight depends on the link: the previous stage's weight gradients
    (then its weights are not released yet, and the next stage's prefetch, which waits for that
    release, has not started) and the previous microbatch's outputs. Each is counted when moving
    it takes longer than the compute reaches its peak (``_seconds_to_peak``). With
    ``link_bytes_per_second`` None (unknown) both always are, and so are the next microbatch's
    inputs from other stages, which bounds every timing. ``recompute``: the grain of backward
    stages (``stage_activation_bytes``).
    """
    n = len(stages)
    prev, stage, nxt = stages[(k - 1) % n], stages[k], stages[(k + 1) % n]
    # The next stage's uploads run during this one only when both are submitted by the same call
    # (a forward and the backward after it are two calls unless the last stage is fused).
    overlaps_next = n > 1 and _phase(plan, nxt) == _phase(plan, stage)

    def pending(nbytes: int) -> bool:
        if link_bytes_per_second is None:
            return True
        return nbytes / link_bytes_per_second > _seconds_to_peak(plan, view, stage)

    prev_grads = view.downloads(prev.start, prev.end) if _is_backward(plan, prev) else 0  # link time
    prefetched = view.weights(nxt.start, nxt.end) if overlaps_next else 0
    going_home = stage_state_bytes(plan, view, prev) if pending(prev_grads) and n > 1 else 0
    weights = stage_state_bytes(plan, view, stage) + max(going_home, prefetched)
    graph, inputs, outputs = stage_activation_bytes(plan, view, stage, recompute)
    if link_bytes_per_second is None:
        ahead = max(inputs, stage_activation_bytes(plan, view, nxt, recompute)[1])
    else:  # what another worker computes for the next microbatch arrives as this one computes
        ahead = max(_inputs_ahead(plan, view, stage) if microbatches != 1 else 0,
                    _inputs_ahead(plan, view, nxt) if overlaps_next else 0)
    forward = stage.direction == "F" and not _is_backward(plan, stage)
    behind = max(outputs, stage_activation_bytes(plan, view, prev, recompute)[2])
    return (weights + graph + inputs + ahead + (outputs if forward else 0)
            + (behind if pending(behind) else 0))


def roundpipe_gpu_bytes(plan: Plan, costs: CostProfile, num_workers: int, continue_round_robin: bool = True,
                        link_bytes_per_second: float | None = None, microbatches: int | None = None,
                        recompute: str = "stage", schedule: Schedule = ROUND_ROBIN) -> list[int]:
    """Peak bytes of each worker while running ``plan``: the largest ``stage_peak_bytes`` of its
    stages. ``link_bytes_per_second`` (default: the profile's; ``math.inf`` for the CPU backend,
    whose transfers are memory copies) decides which transfers may still be pending at a peak;
    ``microbatches`` 1 means no next microbatch is uploaded ahead (None: at least two);
    ``recompute``: the grain of backward stages, "stage" or "layer"; ``schedule``: which stages
    share a worker (``dispatch_order``)."""
    view = CostView(costs)
    link = costs.link_bytes_per_second if link_bytes_per_second is None else link_bytes_per_second
    return [max((stage_peak_bytes(plan, view, stages, k, link, microbatches, recompute) for k in range(len(stages))),
                default=0)
            for stages in worker_stages(plan, num_workers, continue_round_robin, schedule)]


@dataclass
class HostMemory:
    """Host bytes of a training run, by purpose."""

    optimizer_state: int  # fp32 masters, gradients and Adam moments of trainable parameters
    compute_copy: int  # compute-dtype copy of every parameter (uploads read it)
    saved_activations: int  # stage inputs kept for recompute, all microbatches
    gradient_downloads: int = 0  # host buffers the weight gradients land in (their download dtype)
    params: int = 0  # distinct parameters, for the per-parameter figures
    undo_images: int = 0  # the undo journal (optimizer_undo): before-images of master + moments, bounded
    saved_inputs_per_microbatch: int = 0  # stage inputs the forward saves for recompute (backward stages but the first)
    microbatches: int = 0  # microbatches per step the saved activations are counted for

    @property
    def total(self) -> int:
        """All host bytes of the run added up."""
        return (self.optimizer_state + self.compute_copy + self.saved_activations + self.gradient_downloads
                + self.undo_images)

    @property
    def pinned(self) -> int:
        """Bytes page-locked under a pinned policy: what uploads read and downloads land in."""
        return self.compute_copy + self.gradient_downloads + self.saved_activations

    @property
    def pinned_upload_bytes_per_param(self) -> float:
        """Pinned bytes of the upload copy per parameter (2.0 with bf16 shadows, 4.0 in fp32)."""
        return self.compute_copy / self.params if self.params else 0.0


def host_bytes(costs: CostProfile, plan: Plan | None = None, microbatches: int = 1, undo: bool = True,
               journal_bytes: int | None = DEFAULT_UNDO_JOURNAL_BYTES, fused: bool | None = None) -> HostMemory:
    """Host memory of training with ``costs``; activations counted when a plan is given. ``undo``:
    the overlapped optimizer keeps before-images to put a failed step back (``optimizer_undo``,
    on by default wherever the optimizer overlaps, as it does on a GPU server), in a journal of at
    most ``journal_bytes`` (None: no bound). ``fused``: the last stage computes the loss (default:
    the plan's ``fused_last``; without a plan True, as a Hugging Face model given labels runs)."""
    view = CostView(costs)
    acts, saved = 0, 0
    if plan is not None:
        boundaries = [b for b in plan.saved_boundaries() if b > 0]
        saved = len(boundaries)
        acts = microbatches * sum(view.in_bytes(b) for b in boundaries)
    trainable = view.unique_trainable_params()
    copy = view.unique_params() * view.dtype_bytes if costs.host_copy_bytes is None else costs.host_copy_bytes
    fused = (plan.fused_last if plan is not None else True) if fused is None else fused
    journal = trainable * UNDO_BYTES_PER_TRAINABLE if undo else 0
    if journal_bytes is not None:
        journal = min(journal, journal_bytes)
    return HostMemory(trainable * FP32_STATE_BYTES_PER_TRAINABLE, copy, acts,
                      gradient_downloads=gradient_download_bytes(view, plan, fused), params=view.unique_params(),
                      undo_images=journal,
                      saved_inputs_per_microbatch=saved, microbatches=microbatches if plan is not None else 0)


def gradient_download_bytes(view: CostView, plan: Plan | None, fused: bool) -> int:
    """Host bytes the weight-gradient downloads hold at the step's peak (see the module doc): every
    layer's gradients when the call is fused; otherwise the pool's kept free buffers, or one
    backward stage's gradients when those are more."""
    n = len(view.layers)
    if fused:
        return view.downloads(0, n)
    stages = plan.backward_stages() if plan is not None else [Stage("B", 0, l, l + 1) for l in range(n)]
    largest = max((view.downloads(s.start, s.end) for s in stages), default=0)
    return max(min(DOWNLOAD_POOL_CAP_BYTES, view.downloads(0, n)), largest)


def memlock_kib(pinned_bytes: int) -> int:
    """The locked-memory limit (``ulimit -l``, KiB, RLIMIT_MEMLOCK) that covers ``pinned_bytes``
    page-locked bytes, rounded up to whole KiB."""
    return -(-pinned_bytes // 1024)
