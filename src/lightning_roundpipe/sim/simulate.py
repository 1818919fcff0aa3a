"""Simulated RoundPipe training steps: the lowered task graph the engine submits, timed.

Tasks, workers, lanes, dependencies and priorities come from
``lightning_roundpipe.schedule.lowering.lower``, the function that gives the engine its tasks;
this module times them on per-worker upload, compute and download queues, with the host
optimizer and (``SimConfig.host_barriers``) the host's barriers between forward, loss and
backward. Several steps are simulated; the step time is the steady-state period between step
ends. One step as simulated: docs/design.md, design notes, ``sim/simulate.py``; the
assumptions: docs/simulator.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..cost.profile import CostProfile
from ..schedule.history import WorkerHistory
from ..schedule.graph_task import COMPUTE, MAIN_LANE, UPLOAD
from ..schedule.lowering import GraphTask, LoweringOptions, TaskKind
from ..schedule.step_options import EngineOptions
from ..schedule.plan import Plan, PlanError
from ..tracing.records import HOST_WORKER, TraceRecord
from ..cost.view import CostView
from ..cost.memory import UNDO_BYTES_PER_TRAINABLE
from .accumulation import CallAccumulator, submission
from ..schedule.history import LoweredSteps
from ..cost.graph_timing import HOST_LANE, CostSizes, LaneTimer, LaneWork, LinkSpec, task_work
from ..cost.hardware import HardwareProfile
from ..cost.host_update import UNDO_BYTES_PER_PARAM, unscale_seconds, update_seconds


class FusedOnOneWorker:
    """The engine's placement of the fused last stage: every microbatch on the stage's worker.

    The simulator asks a placement to rewrite the fused stage's tasks (``task``), to copy its weight
    uploads (``copy_weights``), to point computes at those copies (``compute_deps``), which computes
    are a worker's first and last of the stage (``first_last``), and, for the stage's gradient
    download when ``spreads`` it, to add one per extra worker (``wgrads``, ``extra_wgrads``). The
    engine's own changes nothing; the analysis layer prices others (``analysis/designs.py``).
    """

    def __init__(self, microbatches: int) -> None:
        self.m = microbatches
        self.extra_wgrads: list[LaneWork] = []

    def spreads(self, t: GraphTask) -> bool:
        """Whether ``t`` belongs to a fused stage this placement spreads over several workers."""
        return False

    def task(self, t: GraphTask) -> GraphTask:
        """``t`` as it runs: on the worker this placement gives it."""
        return t

    def copy_weights(self, op: LaneWork, add) -> None:
        """Add the copies of a weight upload ``op`` that the extra workers need (with ``add``)."""
        return None

    def compute_deps(self, t: GraphTask, deps: list[LaneWork]) -> list[LaneWork]:
        """The ops compute ``t`` waits for (pointing at its worker's copy of the weights)."""
        return deps

    def first_last(self, t: GraphTask) -> tuple[bool, bool]:
        """Whether ``t`` is the first / last microbatch its worker runs of its stage."""
        return t.microbatch == 0, t.microbatch == self.m - 1

    def computed(self, t: GraphTask, op: LaneWork) -> None:
        """Note that ``op`` computes ``t`` (a worker's last compute gates its gradient download)."""
        return None

    def wgrads(self, t: GraphTask, deps: list[LaneWork], step: int, add, out: list) -> LaneWork:
        """The gradient download of a spread stage (never asked of the engine's placement)."""
        raise AssertionError("the engine's fused stage spreads nothing")


class EngineDesign:
    """The engine's design where the simulator could price another (``SimConfig.design``).

    ``call_barrier``: with ``host_barriers``, the next call is dispatched only once this call's
    ``backward()`` has returned (the engine under autograd). ``"step"``: only the first call of an
    optimizer step waits so; the calls that only accumulate go on as soon as the previous call's
    backward is submitted (the engine's ``overlap_calls``, docs/design.md "Backward that returns
    early"). False: no call waits. ``fused_placement``: where the fused
    last stage's microbatches run (``FusedOnOneWorker``).
    """

    call_barrier = True

    def fused_placement(self, plan: Plan, tasks: list[GraphTask], num_workers: int, microbatches: int):
        """Where the fused last stage's microbatches run in this step's ``tasks``."""
        return FusedOnOneWorker(microbatches)


ENGINE_DESIGN = EngineDesign()


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
    # The dispatch order (schedule/dispatch_order.py), as the engine's ``EngineOptions.schedule``.
    schedule: str = "round_robin"
    clip_grad_norm: bool = False  # the optimizer waits for every gradient (global norm) before any update
    # A synchronous offloaded optimizer (ZeRO-Offload's default): it starts once every gradient of
    # the step is home, and the next step's weight uploads wait for the whole update.
    optimizer_barrier: bool = False
    # The engine's host barriers when autograd drives it (RoundPipe steps only): forward -> loss
    # on the host -> backward (not in fused runs), and backward returned -> next step. False
    # models an engine that starts each microbatch's backward on its own output gradient.
    host_barriers: bool = True
    # Forward-backward calls per optimizer step (gradient accumulation): each simulated step is one
    # call; the host optimizer runs once per ``accumulation`` calls, on all of their gradients.
    accumulation: int = 1
    # One-step-stale optimizer (the reference RoundPipe's default): the uploads of optimizer step
    # k + 1 use the weights of step k - 1, so they wait for the update two steps back, not one.
    stale_optimizer: bool = False
    # Host time per submitted task, instead of the hardware profile's ``dispatch_s`` (None: the
    # profile's). One Python process submits every task of every worker, one after another.
    dispatch_s: float | None = None
    # Host time per kernel launch, instead of the profile's ``launch_s`` (None: the profile's; 0:
    # launches cost the host nothing).
    launch_s: float | None = None
    # The design simulated where the simulator can price another: the engine's own (the next call
    # waits for this call's ``backward()`` to return, with ``host_barriers``; the fused last stage
    # runs on one worker). Designs the engine does not have live in the analysis layer
    # (``analysis/designs.py``), which passes them here.
    design: EngineDesign = ENGINE_DESIGN
    # With ``host_barriers``: seconds the host's main thread spends on the loss of a call. Without a
    # fused last stage, computing it from the outputs (between the last output home and the
    # backward dispatch); with one, summing the loss scalars (before ``backward()`` returns).
    host_loss_s: float = 0.0
    # With ``host_barriers``: downloaded gradient bytes per second the main thread adds into the
    # fp32 ``.grad`` (the engine's ``backward()`` does it stage by stage, in dispatch order). A
    # layer's optimizer update waits for its accumulation, and ``backward()`` returns after the
    # last one. None: free.
    host_accumulate_bytes_per_s: float | None = None
    # Layer-grain recompute (recompute="layer"): the lowered backward and fused computes say
    # grain="layer"; each runs its layers but the last once more without grad and holds one
    # layer's graph plus the stage's layer inputs (cost/memory.py: layer_grain_graph).
    layer_recompute: bool = False
    # The overlapped optimizer's failed-step undo (``optim/step_undo.py``): before each layer's
    # update the host copies its fp32 master and Adam moments (``cost/host_update.py``:
    # ``UNDO_BYTES_PER_PARAM`` read and written) at the host copy rate (``undo_seconds``). The
    # copy runs on the optimizer queue as idle work (after ready updates), once the layer's
    # previous update is done, and the layer's update waits for it. False: not priced (the
    # engine's ``optimizer_undo=False``, or a synchronous optimizer, which needs no undo).
    optimizer_undo: bool = False
    # The undo's journal bound (``optimizer_undo_journal_bytes``): layers are journaled in the order
    # their gradients arrive while their before-images (``UNDO_BYTES_PER_TRAINABLE`` per trainable
    # parameter) fit; a layer past it takes no copy and its update waits for every gradient of the
    # step (the step known good), after the journaled ones. None: every layer is journaled.
    undo_journal_bytes: int | None = None
    # fp16's host loss scaler in the overlapped optimizer: each layer's update first unscales and
    # checks its fp32 gradient (``cost/host_update.py``: ``unscale_seconds``), inside the update.
    host_unscale: bool = False
    # With layer_recompute: the layer inputs were kept by the forward stage (the reference
    # RoundPipe downloads each layer's input to the host as its forward runs), so the backward
    # runs no pass without grad first; False: this engine's pass that keeps them.
    layer_inputs_from_forward: bool = False
    # Which ready layer update the host optimizer runs first: "arrival" (in the order the gradients
    # were added, i.e. the last layers first) or "layer" (the lowest layer first: the next step's
    # first uploads get their layers first; the engine's lane, optim/host_lane.py).
    optimizer_order: str = "arrival"

    def __post_init__(self) -> None:
        if self.accumulation < 1:
            raise ValueError(f"accumulation must be at least 1, got {self.accumulation}")
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        for name in ("dispatch_s", "launch_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be None or at least 0, got {value}")
        if not self.host_loss_s >= 0:
            raise ValueError(f"host_loss_s must be at least 0, got {self.host_loss_s}")
        if self.optimizer_order not in ("arrival", "layer"):
            raise ValueError(f"optimizer_order must be 'arrival' or 'layer', got {self.optimizer_order!r}")
        if self.host_accumulate_bytes_per_s is not None and not self.host_accumulate_bytes_per_s > 0:
            raise ValueError(f"host_accumulate_bytes_per_s must be None or positive, got {self.host_accumulate_bytes_per_s}")


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
        """Trained tokens per second (0 for a step that cannot run)."""
        return self.tokens_per_step / self.step_s if self.step_s > 0 and math.isfinite(self.step_s) else 0.0

    @property
    def max_peak_gpu_bytes(self) -> int:
        """The largest per-worker peak of device memory."""
        return max(self.peak_gpu_bytes, default=0)


def link_of(hardware: HardwareProfile, config: SimConfig) -> LinkSpec:
    """The host link of ``hardware``, chunked as ``config`` says."""
    return LinkSpec(hardware.host_device_bytes_per_s, hardware.latency_s, hardware.duplex, config.chunk_bytes)


def summarize(sim: LaneTimer, schedule: str, num_workers: int, microbatches: int, tokens_per_microbatch: int,
              steps: int, **notes) -> SimResult:
    """Step time, bubble and peaks of a finished simulation of ``steps`` identical steps."""
    ends = [0.0] * steps
    busy = [0.0] * steps
    for op in sim.ops:
        ends[op.step] = max(ends[op.step], op.end)
        if op.queue == COMPUTE:
            busy[op.step] += op.end - op.start
    step_s = (ends[-1] - ends[0]) / (steps - 1) if steps > 1 else ends[0]
    bubble = 1.0 - busy[-1] / (num_workers * step_s) if step_s > 0 else 0.0
    peaks = [int(sim.peak_bytes.get(w, 0)) for w in range(num_workers)]
    return SimResult(schedule, step_s, max(0.0, bubble), peaks, list(sim.records), num_workers, microbatches,
                     microbatches * tokens_per_microbatch, notes=dict(notes))


class _RoundPipeBuilder:
    """Times the lowered graph of RoundPipe steps on an ``LaneTimer``.

    Each graph task becomes one operation (a release takes no time: it is done when what it
    waits for is); the history waits resolve on a ``WorkerHistory`` of operations, as the
    engine resolves them on its completions. What the graph leaves to its reader is added
    here: compute seconds and memory from the cost view, the host optimizer that gates each
    layer's next upload, and the host barriers of ``SimConfig``.
    """

    def __init__(self, sim: LaneTimer, plan: Plan, view: CostView, hardware: HardwareProfile,
                 microbatches: int, num_workers: int, config: SimConfig) -> None:
        overrides = {name: getattr(config, name) for name in ("dispatch_s", "launch_s") if getattr(config, name) is not None}
        self.sim, self.plan, self.view, self.hw = sim, plan, view, hardware.replace(**overrides)
        self.m, self.nw, self.cfg = microbatches, num_workers, config
        self.sizes = CostSizes(view)
        self.history: WorkerHistory[list[LaneWork]] = WorkerHistory(num_workers)
        # Host barriers: the op after which the last step's backward returned.
        self.step_done: LaneWork | None = None
        last_updates: dict[int, LaneWork] = {}  # per layer, its latest update (the undo copy waits for it)
        self.calls = CallAccumulator(lambda wgrads, step: add_optimizer(sim, wgrads, view, hardware, config, step,
                                                                        last_updates),
                                     config.accumulation, config.stale_optimizer)
        self.submitted: LaneWork | None = None  # the host's last task submission (dispatch cost)
        # Each step's graph: lowered once per start worker (``schedule/history.py``).
        self.lowered = LoweredSteps(plan, num_workers, self.sizes, LoweringOptions(
            EngineOptions(microbatches=microbatches, recompute=True, layer_recompute=config.layer_recompute,
                          schedule=config.schedule), training=True, fused=plan.fused_last))

    def add(self, op: LaneWork) -> LaneWork:
        return self.sim.add(op)

    def step(self, step: int) -> None:
        cfg, plan, view, m = self.cfg, self.plan, self.view, self.m
        first = self.history.next_worker if cfg.continue_round_robin else 0
        graph = self.lowered.graph(first, self.history.next_serial)
        self.history.advance(graph)
        tasks = graph.tasks
        done: dict[int, list[LaneWork]] = {}  # task id -> the ops that finish it
        outputs_of: dict[int, list[GraphTask]] = {}  # compute id -> its activation downloads
        for t in tasks:
            if t.kind in (TaskKind.ACT_OUT, TaskKind.ACT_SAVE, TaskKind.GRAD_OUT):
                outputs_of.setdefault(t.deps[0], []).append(t)
        backward_stages = {t.stage for t in tasks if t.kind in (TaskKind.FUSED, TaskKind.BACKWARD)}
        host_output = {t.microbatch: t.id for t in tasks if t.kind == TaskKind.ACT_OUT and t.boundary == plan.num_layers}
        barriers = cfg.host_barriers
        barrier = cfg.design.call_barrier
        first_of_step = self.calls.calls % self.calls.accumulation == 0
        waits = barrier is True or (barrier == "step" and first_of_step)
        gate = [self.step_done] if barriers and waits and self.step_done is not None else []
        wgrads: list[tuple[int, LaneWork]] = []
        losses: list[LaneWork] = []
        backward_done: list[LaneWork] = []
        in_backward = False
        spread = cfg.design.fused_placement(plan, tasks, self.nw, m)
        for original in tasks:
            t = spread.task(original)
            if t.phase == "backward" and not in_backward:
                in_backward = True
                if barriers:
                    # The host has the loss once every microbatch's output is home; loss.backward()
                    # then submits the backward phase.
                    outs = [op for i in sorted(host_output) for op in done[host_output[i]]]
                    gate = [self.add(LaneWork(HOST_WORKER, MAIN_LANE, "loss", "", -1, step, seconds=cfg.host_loss_s,
                                        deps=outs + self._main_last()))]
            deps = [op for d in t.deps for op in done[d]]
            deps += [op for ops in self.history.resolve(original) for op in ops]
            host_s = self._host_submit_s(t)
            if host_s > 0:
                self.submitted = submission(self.sim, self.submitted, gate, host_s, t, step)
                deps.append(self.submitted)
            if t.kind in (TaskKind.RELEASE, TaskKind.FREE_KEPT):
                done[t.id] = deps
                if t.stage in backward_stages:
                    backward_done.extend(deps + spread.extra_wgrads)
                self.history.record(original, deps)
                continue
            if t.lane == UPLOAD:
                if t.kind == TaskKind.GRAD_IN and not t.deps and t.boundary == plan.num_layers:
                    deps += done[host_output[t.microbatch]]  # the host computes the loss and its gradient
                if t.kind == TaskKind.WEIGHTS:
                    deps += [op for layer in range(*t.layers) for op in self.calls.gate.get(layer, [])]
                op = task_work(t, view, step, deps + gate)
                if t.kind == TaskKind.WEIGHTS:
                    spread.copy_weights(op, self.add)
            elif t.lane == COMPUTE:
                first_of, last_of = spread.first_last(t)
                op = task_work(t, view, step, spread.compute_deps(t, deps), inputs=[tasks[d] for d in t.deps],
                               outputs=outputs_of.get(t.id, []), first=first_of, last=last_of,
                               inputs_kept=cfg.layer_inputs_from_forward)
                spread.computed(t, op)
            elif t.kind == TaskKind.WGRAD and spread.spreads(t):
                op = spread.wgrads(t, deps, step, self.add, wgrads)
            else:
                op = task_work(t, view, step, deps)
            self.add(op)
            done[t.id] = [op]
            self.history.record(original, [op])
            if t.kind == TaskKind.LOSS:
                losses.append(op)
            elif t.kind == TaskKind.WGRAD:
                wgrads.append((t.layers[0], op))
        if barriers:
            main = self._main_last()
            if plan.fused_last and (cfg.host_loss_s > 0 or cfg.host_accumulate_bytes_per_s):
                # fused: the host sums the loss scalars, in microbatch order, before backward() runs
                main = [self.add(LaneWork(HOST_WORKER, MAIN_LANE, "loss", "", -1, step, seconds=cfg.host_loss_s,
                                    deps=losses + main))]
            if cfg.host_accumulate_bytes_per_s:
                wgrads = self._accumulate(wgrads, main, step)
                main = [wgrads[-1][1]] if wgrads else main
            # backward() returns once the host has the loss and every stage's weight gradients are
            # home (and, when priced, added into .grad); the next step's forward is submitted after
            # that (the optimizer's per-layer updates still overlap it).
            self.step_done = self.add(LaneWork(HOST_WORKER, MAIN_LANE, "step", "", -1, step, deps=backward_done + losses + main))
        self.calls.add_call(wgrads, step)

    def _main_last(self) -> list[LaneWork]:
        """The host main thread's last operation so far (its work runs one after another)."""
        return [self.submitted] if self.submitted is not None else []

    def _accumulate(self, wgrads: list[tuple[int, LaneWork]], after: list[LaneWork], step: int) -> list[tuple[int, LaneWork]]:
        """The main thread adding each downloaded gradient into ``.grad``, in dispatch order, after
        ``after``; returns (layer, accumulation) pairs, what each layer's optimizer update waits for."""
        rate, out = self.cfg.host_accumulate_bytes_per_s, []
        for layer, download in wgrads:
            acc = self.add(LaneWork(HOST_WORKER, MAIN_LANE, "accumulate", f"L{layer}", -1, step, seconds=download.bytes / rate,
                              deps=[download] + after))
            out.append((layer, acc))
            after = [acc]
        return out

    def _host_submit_s(self, t: GraphTask) -> float:
        """Host time to submit ``t``: ``dispatch_s``, plus for a compute task the launches of its
        decoder layers. The issue is charged before the task starts (no overlap of issuing with
        the device running what was issued): an upper bound on the launch cost."""
        if t.kind in (TaskKind.RELEASE, TaskKind.FREE_KEPT):
            return 0.0
        seconds = self.hw.dispatch_s
        span = self.view.costs.decoder_layers
        if t.lane == COMPUTE and span is not None and self.hw.launch_s > 0:
            n = max(0, min(t.end, span[1]) - max(t.start, span[0]))
            seconds += self.hw.launch_seconds(t.kind, n)
            extra = self.view.costs.extra_launches_per_decoder_layer[0 if t.kind == TaskKind.FORWARD else 1]
            seconds += n * extra * self.hw.launch_s  # an MoE layer's expert dispatch (cost/moe_loop.py)
        return seconds


UNDO_PRIORITY = 1 << 30  # after every ready update, whatever order the updates run in
PAST_JOURNAL_PRIORITY = 1 << 20  # updates past the undo journal: after the journaled ones, lowest layer first


def undo_seconds(trainable_params: int, hardware: HardwareProfile) -> float:
    """Host seconds of the undo copy of ``trainable_params`` parameters: their copy traffic at the
    profile's host memory bandwidth, or, without one, at the bandwidth its optimizer rate implies
    (``optimizer_params_per_s`` x ``optimizer_bytes_per_param``)."""
    rate = hardware.host_memory_bytes_per_s or hardware.optimizer_params_per_s * hardware.optimizer_bytes_per_param
    return trainable_params * UNDO_BYTES_PER_PARAM / rate


def add_optimizer(sim: LaneTimer, wgrads: dict[int, list[LaneWork]], view: CostView, hardware: HardwareProfile,
                  config: SimConfig, step: int, previous: dict[int, LaneWork] | None = None) -> dict[int, list[LaneWork]]:
    """Host optimizer updates of one step, in the order the gradients were added.

    ``previous``: per layer, its last update so far (read for the undo copy, then set to this
    step's). Returns, per layer, the updates the next step's upload of that layer must wait for.
    """
    everything = [op for ops in wgrads.values() for op in ops]
    wait_for_all = config.clip_grad_norm or config.optimizer_barrier
    previous = {} if previous is None else previous
    updates: dict[int, LaneWork] = {}
    journal = config.undo_journal_bytes
    for layer, ops in wgrads.items():
        image = view.trainable[layer] * UNDO_BYTES_PER_TRAINABLE
        past_journal = config.optimizer_undo and journal is not None and image > journal
        if config.optimizer_undo and journal is not None and not past_journal:
            journal -= image
        deps = list(everything if wait_for_all or past_journal else ops)
        n = view.trainable[layer]
        seconds = update_seconds(n, hardware) + (unscale_seconds(n, hardware) if config.host_unscale else 0.0)
        if past_journal:
            priority = PAST_JOURNAL_PRIORITY + layer
        else:
            if config.optimizer_undo and n:
                last = previous.get(layer)
                deps.append(sim.add(LaneWork(HOST_WORKER, HOST_LANE, "undo", f"L{layer}", -1, step,
                                             seconds=undo_seconds(n, hardware), priority=UNDO_PRIORITY,  # idle work
                                             deps=[last] if last is not None else [])))
            # "arrival": equal priorities, so ready updates run in the order they became ready
            priority = layer if config.optimizer_order == "layer" else 0
        updates[layer] = previous[layer] = sim.add(LaneWork(HOST_WORKER, HOST_LANE, "optim", f"L{layer}", -1, step,
                                                            seconds=seconds, priority=priority, deps=deps))
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
    ``transformer_layer_costs`` or measured by the
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
    sim = LaneTimer(link_of(hardware, cfg))
    builder = _RoundPipeBuilder(sim, plan, view, hardware, microbatches, nw, cfg)
    for step in range(cfg.steps):
        builder.step(step)
    sim.run()
    return summarize(sim, "roundpipe", nw, microbatches, view.tokens, cfg.steps, plan=plan.to_text())
