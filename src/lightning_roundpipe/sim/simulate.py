"""Simulated RoundPipe training steps over the same plan and dispatch data the engine runs.

One step, as the engine runs it (see ``docs/simulator.md`` for the assumptions):

- Tasks come from :func:`lightning_roundpipe.schedule.plan.dispatch`: forward stages in order, then the
  backward stages of :meth:`Plan.dispatched_backward_stages`, each to the next worker. With
  ``continue_round_robin`` the next step's dispatch starts on the worker after the last one.
- Every worker has an upload, a compute and a download queue. A task uploads its layers'
  weights, then per microbatch uploads its input (and for backward the output gradient),
  computes, and downloads its output (and the stage-internal activations backward recompute
  starts from, and for backward the input gradient). The weights of a task may upload only when the worker's task two back
  has finished computing and sent its gradients home: at most two stages' weights are resident.
- Uploads go by dispatch order, then kind (``SimConfig.upload_order="stage"``, as the engine):
  a stage's inputs, then its weights, before anything of a later stage, so the next stage's
  weight prefetch fills the gaps while the running stage waits for its inputs. Downloads go by
  kind, then dispatch order: activations and input gradients, then weight gradients.
- Microbatch i of a stage waits only for microbatch i of the stage before it (event-based
  synchronisation), and an activation moves from worker to worker through host memory.
- The fused last stage runs forward, loss and backward of its layers per microbatch.
- After a stage's last backward microbatch its weight gradients go home (lowest priority), layer
  by layer; the host optimizer updates each layer once its gradients have arrived (or after all
  of them with ``clip_grad_norm``), and the next step's upload of a layer waits for it.
- Host barriers (``SimConfig.host_barriers``, on by default): the engine is driven by autograd,
  so without a fused last stage the host computes the loss from every microbatch's output
  before ``loss.backward()`` dispatches the backward stages (a fused run dispatches them right
  after the fused stage), and in every run the next step is dispatched only once ``backward()``
  has returned (every weight gradient and loss scalar home). Nothing a dispatch submits
  (weight or input uploads) starts earlier. Off, the backward of microbatch i starts as soon as
  its own output gradient exists and the next step's weights prefetch during this step's tail:
  what an engine that started backward per microbatch could reach.

Several steps are simulated; the step time is the steady-state period between step ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..cost.profile import CostProfile
from ..schedule.plan import Plan, PlanError, dispatch
from ..tracing.records import TraceRecord
from ..cost.view import CostView
from .event_queue import HOST, EventSimulator, LinkSpec, Op
from .hardware import HardwareProfile

# Transfer priorities by kind (lower goes first): what a stage waits for, then weight prefetch,
# then gradients going home. Uploads put the dispatch order before these (SimConfig.upload_order).
PRIO_ACTIVATIONS = 0
PRIO_WEIGHTS = 1
PRIO_GRADS = 2
UPLOAD_KINDS = 2  # upload priorities per task with upload_order="stage" (activations, weights)
LOSS_BYTES = 4  # one fp32 loss scalar per microbatch (fused last stage)
MAIN_QUEUE = "main"  # the host thread that drives the step (loss, dispatch); the optimizer has its own queue


@dataclass
class SimConfig:
    """Knobs of a simulation that are not part of the plan, the costs or the hardware.

    ``host_barriers`` (default True) models the engine as it runs when autograd drives it, from
    Lightning or plain PyTorch. Without a fused last stage, ``model(batch)`` returns only when
    every microbatch's output is on the host, the host computes the loss, and ``loss.backward()``
    dispatches the backward stages (so no backward weight or input upload starts before the
    loss). A fused run has no such barrier: the engine dispatches the backward stages right after
    the fused stage (backward is linear in the loss gradient; the host scales the result). In
    both, the next step's forward is dispatched only when ``backward()`` has returned, i.e. every
    weight gradient (and loss scalar) is home; the host optimizer still overlaps, per layer.
    ``host_barriers=False`` lets microbatch i's backward start on its own output gradient and the
    next step prefetch during this one: what an engine that started backward per microbatch
    could reach. Bound schedules ignore the option.
    """

    steps: int = 3  # steps simulated; the step time is the mean period after the first one
    chunk_bytes: int = 32 * 2**20  # transfers are cut into chunks; an urgent one overtakes at a boundary
    continue_round_robin: bool = True  # the next step's first task goes to the worker after the last one
    clip_grad_norm: bool = False  # the optimizer waits for every gradient (global norm) before any update
    # Which ready layer the host optimizer updates first: "arrival" (as gradients come home, last
    # layers first) or "layer" (lowest layer first: the next forward needs those first).
    optimizer_order: str = "arrival"
    # A synchronous offloaded optimizer (ZeRO-Offload's default): it starts once every gradient of
    # the step is home, and the next step's weight uploads wait for the whole update.
    optimizer_barrier: bool = False
    # The engine's host barriers when autograd drives it (RoundPipe steps only): forward -> loss
    # on the host -> backward (not in fused runs), and backward returned -> next step. False
    # models an engine that starts each microbatch's backward on its own output gradient.
    host_barriers: bool = True
    # Upload priority: "stage" (dispatch order first, then kind: the running stage's weights and
    # inputs go before anything of a later stage, as the engine orders them) or "kind"
    # (activations of any stage before any weights: the engine before it keyed on stage order).
    upload_order: str = "stage"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.optimizer_order not in ("arrival", "layer"):
            raise ValueError(f"optimizer_order must be 'arrival' or 'layer', got {self.optimizer_order!r}")
        if self.upload_order not in ("stage", "kind"):
            raise ValueError(f"upload_order must be 'stage' or 'kind', got {self.upload_order!r}")

    def upload_priority(self, task_serial: int, kind_priority: int) -> int:
        """Link priority of an upload for the ``task_serial``-th dispatched task (lower goes first)."""
        return task_serial * UPLOAD_KINDS + kind_priority if self.upload_order == "stage" else kind_priority

    def optimizer_priority(self, layer: int) -> int:
        """Host-queue priority of a layer's optimizer update (lower runs first among ready ones)."""
        return layer if self.optimizer_order == "layer" else 0


@dataclass
class SimResult:
    """Predicted time and memory of a steady training step, and the simulated timeline."""

    schedule: str
    step_s: float  # steady-state seconds per step
    bubble_fraction: float  # idle share of the workers' compute queues within a step
    peak_gpu_bytes: list[int]  # per worker, over the whole simulation
    timeline: list[TraceRecord]  # every simulated task, all steps (``step`` field set)
    num_workers: int
    microbatches: int
    tokens_per_step: int
    fits: bool = True  # False when the schedule's memory needs exceed the worker memory
    notes: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 and math.isfinite(self.step_s) else 0.0

    @property
    def max_peak_gpu_bytes(self) -> int:
        return max(self.peak_gpu_bytes, default=0)


def link_of(hardware: HardwareProfile, config: SimConfig) -> LinkSpec:
    return LinkSpec(hardware.host_device_bytes_per_s, hardware.latency_s, hardware.duplex, config.chunk_bytes)


def summarize(sim: EventSimulator, schedule: str, num_workers: int, microbatches: int, tokens_per_microbatch: int,
              steps: int, **notes) -> SimResult:
    """Step time, bubble and peaks of a finished simulation of ``steps`` identical steps."""
    ends = [0.0] * steps
    busy = [0.0] * steps
    for op in sim.ops:
        ends[op.step] = max(ends[op.step], op.end)
        if op.queue == "compute":
            busy[op.step] += op.end - op.start
    step_s = (ends[-1] - ends[0]) / (steps - 1) if steps > 1 else ends[0]
    bubble = 1.0 - busy[-1] / (num_workers * step_s) if step_s > 0 else 0.0
    peaks = [int(sim.peak_bytes.get(w, 0)) for w in range(num_workers)]
    return SimResult(schedule, step_s, max(0.0, bubble), peaks, list(sim.records), num_workers, microbatches,
                     microbatches * tokens_per_microbatch, notes=dict(notes))


class _RoundPipeBuilder:
    """Adds the operations of RoundPipe steps to an :class:`EventSimulator`."""

    def __init__(self, sim: EventSimulator, plan: Plan, view: CostView, hardware: HardwareProfile,
                 microbatches: int, num_workers: int, config: SimConfig) -> None:
        self.sim, self.plan, self.view, self.hw = sim, plan, view, hardware
        self.m, self.nw, self.cfg = microbatches, num_workers, config
        self.first_worker = 0
        self.releases: list[list[list[Op]]] = [[] for _ in range(num_workers)]  # per task: ops that free its memory
        self.computes: list[list[Op]] = [[] for _ in range(num_workers)]  # compute queue, in order
        self.outputs: list[list[list[Op]]] = [[] for _ in range(num_workers)]  # downloads of each compute
        self.optim_prev: dict[int, list[Op]] = {}  # layer -> optimizer updates its next upload waits for
        # Host barriers: the ops every upload of the tasks being dispatched now waits for (the host
        # submits those tasks only after them), and the op after which the last step's backward returned.
        self.gate: list[Op] = []
        self.step_done: Op | None = None
        self.serial = 0  # tasks dispatched so far, all steps (the engine's stage order)

    def add(self, op: Op) -> Op:
        return self.sim.add(op)

    def step(self, step: int) -> None:
        tasks = dispatch(self.plan, self.nw, self.first_worker)
        if self.cfg.continue_round_robin:
            self.first_worker = (self.first_worker + len(tasks)) % self.nw
        self.act_src: dict[tuple[int, int], Op] = {}  # (layer boundary, mb) -> op that put the activation on the host
        self.grad_src: dict[tuple[int, int], Op] = {}  # (layer boundary, mb) -> op that put the gradient on the host
        self.wgrads: list[tuple[int, Op]] = []
        self.losses: list[Op] = []  # fused last stage: the download of each microbatch's loss scalar
        self.backward_done: list[Op] = []  # what backward() waits for before it returns
        barriers = self.cfg.host_barriers
        n_forward = len(self.plan.forward)
        self.gate = [self.step_done] if barriers and self.step_done is not None else []
        for task in tasks[:n_forward]:
            self._task(task.stage, task.worker, step)
        if barriers and not self.plan.fused_last:
            # The host has the loss once every microbatch's output is home; loss.backward() then
            # dispatches the backward stages. (A fused run dispatches them right after the fused
            # stage, without waiting: backward is linear in the loss gradient, scaled on the host.)
            outputs = [self.act_src[(self.plan.num_layers, i)] for i in range(self.m)]
            self.gate = [self.add(Op(HOST, MAIN_QUEUE, "loss", "", -1, step, deps=outputs))]
        for task in tasks[n_forward:]:
            self._task(task.stage, task.worker, step)
        if barriers:
            # backward() returns once the host has the loss and every stage's weight gradients are
            # home; the next step's forward is dispatched after that (the optimizer's per-layer
            # updates still overlap it).
            self.step_done = self.add(Op(HOST, MAIN_QUEUE, "step", "", -1, step,
                                         deps=self.backward_done + self.losses))
        by_layer: dict[int, list[Op]] = {}
        for layer, op in self.wgrads:
            by_layer.setdefault(layer, []).append(op)
        self.optim_prev = add_optimizer(self.sim, by_layer, self.view, self.hw, self.cfg, step)

    def _task(self, stage, w: int, step: int) -> None:
        view, plan, m = self.view, self.plan, self.m
        a, b, name = stage.start, stage.end, stage.name
        fused = plan.fused_last and stage.direction == "F" and stage.index == len(plan.forward) - 1
        backward = stage.direction == "B" or fused
        serial, self.serial = self.serial, self.serial + 1
        input_priority = self.cfg.upload_priority(serial, PRIO_ACTIVATIONS)

        # Weights, layer by layer, into one of the worker's two stage slots.
        slot = self.releases[w][-2] if len(self.releases[w]) >= 2 else []
        weight_ops = []
        for layer in range(a, b):
            nbytes = view.layers[layer].weight_bytes
            deps = list(slot) + self.optim_prev.get(layer, []) + self.gate
            weight_ops.append(self.add(Op(w, "upload", "weights", name, -1, step, bytes=nbytes,
                                          priority=self.cfg.upload_priority(serial, PRIO_WEIGHTS), deps=deps,
                                          alloc=[(w, nbytes)])))
        weights_total = view.weights(a, b)
        grads_total = view.grads(a, b) if backward else 0

        if stage.direction == "F" and not fused:
            seconds, kind, transient = view.forward_s(a, b), "forward", view.max_layer_graph(a, b)
        elif fused:
            seconds, kind, transient = view.fused_s(a, b), "fused", view.graph(a, b)
        else:
            seconds, kind, transient = view.backward_with_recompute_s(a, b), "backward", view.graph(a, b)
        # Stage-internal boundaries whose activations backward recompute starts from.
        saves = [c for c in plan.saved_boundaries() if a < c < b] if stage.direction == "F" else []

        compute = None
        for i in range(m):
            n = len(self.computes[w])
            # Double buffering: inputs of compute n upload once compute n-2 is done, and compute n
            # starts once the outputs of compute n-2 are home.
            buffer_deps = [self.computes[w][n - 2]] if n >= 2 else []
            output_deps = self.outputs[w][n - 2] if n >= 2 else []
            # Every stage needs its input (backward: the saved one, for recompute); backward also
            # needs the gradient of its output.
            inputs = [self._upload(w, "act_in", name, i, step, view.in_bytes(a), self.act_src.get((a, i)), buffer_deps,
                                   input_priority)]
            if stage.direction == "B":
                inputs.append(self._upload(w, "grad_in", name, i, step, view.out_bytes(b - 1),
                                           self.grad_src.get((b, i)), buffer_deps, input_priority))
            outputs: list[tuple[str, int, int]] = []  # (kind, bytes, boundary)
            if stage.direction == "F" and not fused:
                outputs.append(("act_out", view.out_bytes(b - 1), b))
                outputs.extend(("act_save", view.in_bytes(c), c) for c in saves)
            elif a > 0:
                outputs.append(("grad_out", view.in_bytes(a), a))  # gradient of the stage input, same size
            out_total = sum(nbytes for _, nbytes, _ in outputs)
            in_total = sum(op.bytes for op in inputs)
            alloc = [(w, transient + out_total)] + ([(w, grads_total)] if i == 0 and grads_total else [])
            free = [(w, transient + in_total)] + ([(w, weights_total)] if i == m - 1 else [])
            compute = self.add(Op(w, "compute", kind, name, i, step, seconds=seconds,
                                  deps=weight_ops + inputs + list(output_deps), alloc=alloc, free=free))
            downloads = []
            if fused and self.cfg.host_barriers:
                # The loss scalar goes home ahead of the input gradient; backward() needs the sum.
                loss = self.add(Op(w, "download", "loss", name, i, step, bytes=LOSS_BYTES, priority=PRIO_ACTIVATIONS,
                                   deps=[compute]))
                downloads.append(loss)
                self.losses.append(loss)
            for out_kind, nbytes, boundary in outputs:
                op = self.add(Op(w, "download", out_kind, name, i, step, bytes=nbytes, priority=PRIO_ACTIVATIONS,
                                 deps=[compute], free=[(w, nbytes)]))
                downloads.append(op)
                if out_kind == "grad_out":
                    self.grad_src[(boundary, i)] = op
                else:
                    self.act_src[(boundary, i)] = op
                    if boundary == plan.num_layers:
                        self.grad_src[(boundary, i)] = op  # the host computes the loss and its gradient
            self.computes[w].append(compute)
            self.outputs[w].append(downloads)

        release = [compute]
        if backward:
            for layer in reversed(range(a, b)):
                nbytes = view.layers[layer].grad_bytes
                if nbytes <= 0:
                    continue
                op = self.add(Op(w, "download", "wgrad", name, -1, step, bytes=nbytes, priority=PRIO_GRADS,
                                 deps=[compute], free=[(w, nbytes)]))
                self.wgrads.append((layer, op))
                release.append(op)
            self.backward_done.extend(release)
        self.releases[w].append(release)

    def _upload(self, w: int, kind: str, name: str, mb: int, step: int, nbytes: int, source: Op | None,
                buffer_deps: list[Op], priority: int) -> Op:
        deps = ([source] if source is not None else []) + list(buffer_deps) + self.gate
        return self.add(Op(w, "upload", kind, name, mb, step, bytes=nbytes, priority=priority,
                           deps=deps, alloc=[(w, nbytes)]))


def add_optimizer(sim: EventSimulator, wgrads: dict[int, list[Op]], view: CostView, hardware: HardwareProfile,
                  config: SimConfig, step: int) -> dict[int, list[Op]]:
    """Host optimizer updates of one step, in the order the gradients were added.

    Returns, per layer, the updates the next step's upload of that layer must wait for.
    """
    everything = [op for ops in wgrads.values() for op in ops]
    wait_for_all = config.clip_grad_norm or config.optimizer_barrier
    updates: dict[int, Op] = {}
    for layer, ops in wgrads.items():
        seconds = view.trainable[layer] / hardware.cpu_optimizer_params_per_s
        updates[layer] = sim.add(Op(HOST, "host", "optim", f"L{layer}", -1, step, seconds=seconds,
                                    priority=config.optimizer_priority(layer),
                                    deps=list(everything if wait_for_all else ops)))
    if config.optimizer_barrier:
        every_update = list(updates.values())
        return {layer: every_update for layer in range(len(view))}
    return {layer: [op] for layer, op in updates.items()}


def simulate_roundpipe(
    plan: Plan,
    costs: CostProfile,
    hardware: HardwareProfile,
    microbatches: int,
    *,
    num_workers: int | None = None,
    config: SimConfig | None = None,
) -> SimResult:
    """Simulate RoundPipe steps of ``plan`` with ``microbatches`` microbatches per step.

    ``costs`` holds per-microbatch layer costs (estimated by
    :func:`~lightning_roundpipe.cost.transformer.transformer_layer_costs` or measured by the
    engine); ``hardware`` gives the link (``host_device_bytes_per_s``, ``latency_s``,
    ``duplex``) and the host optimizer speed. ``num_workers`` defaults to ``hardware.num_gpus``.
    To check the simulator against the CPU backend, pass a profile whose link numbers are the
    bandwidth limit and delay injected there, and the costs the engine measured.
    """
    plan.validate()
    if len(costs.layers) != plan.num_layers:
        raise PlanError(f"the plan covers {plan.num_layers} layers but the cost profile has {len(costs.layers)}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")
    nw = hardware.num_gpus if num_workers is None else int(num_workers)
    cfg = config or SimConfig()
    view = CostView(costs)
    sim = EventSimulator(link_of(hardware, cfg))
    builder = _RoundPipeBuilder(sim, plan, view, hardware, microbatches, nw, cfg)
    for step in range(cfg.steps):
        builder.step(step)
    sim.run()
    return summarize(sim, "roundpipe", nw, microbatches, view.tokens, cfg.steps, plan=plan.to_text())
