"""This project's engine on the reference benchmark's workload, and where it differs from the reference.

The published RoundPipe runs (``PUBLISHED_RUNS``) used fp16 accumulation, a one-step-stale
optimizer, its own partitioner and 10 microbatches per call; this engine runs bf16-mixed, the
exact overlapped optimizer, its own partition and the host work of one Python process. A
``Setup`` holds one way to run; ``waterfall`` changes one cause at a time from the reference's
setup to this engine's default, so every difference has a name and a share; ``best_setup``
searches what a user can set. All simulated. Details: docs/design.md, design notes,
``analysis/own_engine.py``; results: docs/reference_workload.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from lightning_roundpipe.cost.attention_blocks import attention_flops_per_token
from lightning_roundpipe.cost.compiled import compiled_launches
from lightning_roundpipe.cost.profile import CostProfile
from lightning_roundpipe.cost.memory import roundpipe_gpu_bytes
from .precision import check_precision, fp16_accumulation
from lightning_roundpipe.cost.transformer import get_model_shape, shape_layer_costs
from lightning_roundpipe.planning.capacity import DEFAULT_MEMORY_FRACTION, best_plan
from lightning_roundpipe.planning.partition import partition
from lightning_roundpipe.schedule.plan import Plan, PlanError
from lightning_roundpipe.cost.hardware import HardwareProfile, load_hardware
from lightning_roundpipe.sim.simulate import SimConfig, SimResult, simulate_roundpipe
from .workload import PUBLISHED_RUNS, PublishedRun, Workload, optimizer_step_period, reference_plan
from .designs import PricedDesign

# Measured ratio of one host Adam step to the engine's gradient accumulation (cast to fp32,
# multiply by the loss scale, add into .grad), per parameter, side by side on one CPU:
# `python -m benchmarks.calibration.host_accumulate_cost` printed adam / cast-scale-add = 1.25, 1.99 and 2.35
# in three runs (16M parameters, 2 torch threads, best of 7, load average ~7); the lowest is taken,
# so the accumulation's simulated cost is an upper bound. Both are memory-bound, so the ratio
# carries over to a server whose host Adam rate the profile gives.
ADAM_PER_ACCUMULATE = 1.25
GRAD_BYTES = 2  # bf16 / fp16 gradients come home in the compute dtype
PLANNER = "planner"  # plan from the planner's candidates, timed by the simulator (fit.best_plan)
REFERENCE = "reference"  # the reference's own partition of the model (workload.reference_plan)
# What a GPU backend's first plan assumes before anything is measured (``workers/pool.py``:
# ``WorkerPool.assumed_flops_per_s`` and ``assumed_link_bytes_per_s``; the analysis layer does not
# import the workers, so ``tests/lab/test_sim_partition_choice.py`` pins them equal).
ENGINE_ESTIMATE_FLOPS_PER_S = 1e14
ENGINE_ESTIMATE_LINK_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class Setup:
    """One way to run a workload: the options a user sets and the host work the engine does per call.

    ``microbatches`` / ``calls`` None: the workload's (the reference's) counts; ``microbatches``
    ``ENGINE_CHOICE``: chosen as the engine chooses an open count. ``partition``: a
    policy of ``partition``, ``"planner"`` or ``"reference"`` (the reference's own partition);
    ``"compute"`` (the engine's default) is searched on the engine's own FLOP estimate
    (``engine_estimate``), as the engine plans it once before anything is measured, and ``"auto"``
    on the simulated costs, standing for the measured costs the engine's ``auto`` policy re-plans from.
    ``precision``: ``"fp16-acc"`` (fp16 with ``allow_fp16_accumulation``: matmuls at the
    fp16-accumulate rate) or ``"bf16-mixed"`` (fp32-accumulate rate). ``staleness``: 0 exact, 1
    one step stale. ``wait_all_grads``: the optimizer starts only when every gradient of the step
    is home (this engine's host loss scaler under fp16 checks them all for overflow first).
    ``dispatch_s`` / ``launch_s``: host seconds per task / kernel launch (None: the profile's).
    ``host_accumulate_bytes_per_s``, ``host_loss_s``: see ``SimConfig``; ``call_barrier``, ``fused_spread``:
    designs the engine does not have, see ``analysis.designs``.
    ``host_barriers``: the engine under autograd (the next call waits for ``backward()``; see
    ``SimConfig``); the reference dispatches without them. ``compiled_layers``: decoder layers
    through ``torch.compile`` (``cost.compiled``: fused element-wise traffic, fewer launches).
    ``optimizer_order``: which ready layer update the host runs first (``SimConfig``; the
    engine's lane: ``"layer"``, ``optim/host_lane.py``; the reference's is not published:
    ``"arrival"``). ``undo``: the before-image copy that keeps a failed step undoable
    (``cost.host_update``; the engine's ``optimizer_undo``, on by default).
    ``host_unscale``: each layer's update first unscales and checks its gradient (this engine's
    host loss scaler under fp16, ``cost.host_update.unscale_seconds``). ``early_stop``: the engine's
    ``recompute_early_stop`` (needs ``compiled_layers``): the last decoder layer of each backward stage
    does not recompute its MLP down projection (``LayerCost.early_stop_s``).
    """

    precision: str = "fp16-acc"
    staleness: int = 1
    partition: str = PLANNER
    microbatches: int | str | None = None
    calls: int | None = None
    loss_chunk_tokens: int = 2048
    wait_all_grads: bool = False
    dispatch_s: float | None = None
    launch_s: float | None = None
    host_accumulate_bytes_per_s: float | None = None
    host_loss_s: float = 0.0
    call_barrier: bool | str = True
    fused_spread: int = 1
    host_barriers: bool = False
    compiled_layers: bool = False
    optimizer_order: str = "arrival"
    undo: bool = False
    host_unscale: bool = False
    early_stop: bool = False

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.early_stop and not self.compiled_layers:
            raise ValueError("early_stop is a compiled graph: it needs compiled_layers=True")
        if self.staleness not in (0, 1):
            raise ValueError(f"staleness must be 0 or 1, got {self.staleness!r}")

    def sim_config(self, workload: Workload, optimizer_steps: int) -> SimConfig:
        """The workload's simulator options (as the reference rows get them), with this setup's."""
        return replace(workload.sim_config(optimizer_steps), stale_optimizer=self.staleness == 1,
                       optimizer_barrier=False, clip_grad_norm=self.wait_all_grads, dispatch_s=self.dispatch_s,
                       launch_s=self.launch_s, host_accumulate_bytes_per_s=self.host_accumulate_bytes_per_s,
                       host_loss_s=self.host_loss_s, host_barriers=self.host_barriers,
                       optimizer_order=self.optimizer_order,
                       optimizer_undo=self.undo, host_unscale=self.host_unscale,
                       design=PricedDesign(call_barrier=self.call_barrier, fused_spread=self.fused_spread))


@dataclass
class SetupResult:
    """A simulated setup: tokens/s over optimizer steps, or why it does not run."""

    setup: Setup
    microbatches: int
    calls: int
    tokens_per_s: float  # 0 when it does not fit
    bubble: float = 0.0
    plan: Plan | None = None
    gpu_bytes: int = 0  # the planner's per-worker bound of the busiest worker
    refused: str = ""  # why it does not run (memory), else ""
    call: SimResult | None = None


ENGINE_CHOICE = "engine's choice"  # Setup.microbatches: chosen as the engine chooses an open count


def default_microbatches(num_workers: int) -> int | str:
    """This engine's default microbatch count (``RuntimeOptions().microbatches``): a count, or
    ``ENGINE_CHOICE`` when the default is open (None: the engine picks among
    ``planning.defaults.MICROBATCHES_PER_WORKER`` x workers the fewest predicted within the tie
    tolerance of the fastest; ``simulate_setup`` does the same with the simulator)."""
    from lightning_roundpipe.options import RuntimeOptions

    value = RuntimeOptions().microbatches
    if value is None:
        return ENGINE_CHOICE
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"RuntimeOptions().microbatches defaults to {value!r}: teach analysis/own_engine.default_microbatches "
                     f"how the engine turns that into a count")


def microbatch_candidates(num_workers: int) -> list[int]:
    """The counts an open microbatch default chooses from (``planning.defaults``)."""
    from lightning_roundpipe.planning.defaults import MICROBATCHES_PER_WORKER

    return [k * num_workers for k in MICROBATCHES_PER_WORKER]


def default_partition() -> str:
    """This engine's default partition policy (``PartitionConfig().policy``)."""
    from lightning_roundpipe.options import PartitionConfig

    return PartitionConfig().policy


def host_accumulate_rate(hardware: HardwareProfile) -> float:
    """Gradient bytes per second the main thread adds into ``.grad`` on ``hardware``'s host:
    the profile's Adam rate times the measured ``ADAM_PER_ACCUMULATE``, in bf16 bytes."""
    return hardware.cpu_optimizer_params_per_s * ADAM_PER_ACCUMULATE * GRAD_BYTES


def dispatch_figure() -> float:
    """Host seconds per submitted task measured on the CPU backend (``cost/profiles/cpu2.yaml``)."""
    return load_hardware("cpu2").dispatch_s


def default_compiled_layers() -> bool:
    """Whether this engine compiles decoder layers by default on a GPU (``RuntimeOptions().compile_layers``:
    True, or None meaning the CUDA backend's rule, ``workers.cuda.inductor_generates_gpu_code``,
    which holds on the simulated GPUs: Triton ships with torch's CUDA wheels and every profile is
    sm70 or newer; False: eager)."""
    from lightning_roundpipe.options import RuntimeOptions

    value = RuntimeOptions().compile_layers
    return value is None or value is True


def default_early_stop() -> bool:
    """Whether this engine's recompute stops early by default on a GPU (``RuntimeOptions().recompute_early_stop``:
    None follows the layers, on where they are compiled, ``default_compiled_layers``; True or False as set)."""
    from lightning_roundpipe.options import RuntimeOptions

    value = RuntimeOptions().recompute_early_stop
    return value is not False and default_compiled_layers()


def default_undo() -> bool:
    """Whether this engine keeps a failed step undoable by default (``RuntimeOptions().optimizer_undo``)."""
    from lightning_roundpipe.options import RuntimeOptions

    return bool(getattr(RuntimeOptions(), "optimizer_undo", False))


def default_call_barrier() -> bool | str:
    """The simulator's call barrier for this engine's default ``overlap_calls``
    (``RuntimeOptions().overlap_calls``): ``"step"`` when on (only the first call of an optimizer
    step waits for the previous ``backward()``; an accumulation-only backward returns once its
    stages are submitted), True when off (every call waits)."""
    from lightning_roundpipe.options import RuntimeOptions

    return "step" if getattr(RuntimeOptions(), "overlap_calls", False) else True


ENGINE_OPTIMIZER_ORDER = "layer"  # optim/host_lane.py: waiting layer updates run lowest layer first


def our_default(hardware: HardwareProfile) -> Setup:
    """This engine's default configuration and per-call host work on ``hardware``: driven by
    autograd (host barriers; with ``overlap_calls`` on, as by default, only a step's first call
    waits for the previous ``backward()``), the failed-step undo, compiled layers and the early-stopping
    recompute as the options default."""
    nw = hardware.num_gpus
    return Setup(precision="bf16-mixed", staleness=0, partition=default_partition(),
                 microbatches=default_microbatches(nw), loss_chunk_tokens=1024, dispatch_s=dispatch_figure(),
                 host_accumulate_bytes_per_s=host_accumulate_rate(hardware), host_barriers=True,
                 undo=default_undo(), compiled_layers=default_compiled_layers(), early_stop=default_early_stop(),
                 call_barrier=default_call_barrier(), optimizer_order=ENGINE_OPTIMIZER_ORDER)


def engine_estimate(costs: CostProfile, attention_flops_per_token: float = 0.0) -> CostProfile:
    """The costs a GPU run of the engine plans its first plan on, rebuilt from a shape's ``costs``.

    The engine's keeper (``planning/keeper.py``) estimates every layer with
    ``cost.estimate.estimate_costs`` for ``ASSUMED_TOKENS_PER_MICROBATCH`` tokens per microbatch,
    whatever the batch: forward ``(2 x matmul parameters + output elements + attention) x tokens``
    FLOPs at ``ENGINE_ESTIMATE_FLOPS_PER_S``, recompute the forward again, backward twice the
    forward, the link at ``ENGINE_ESTIMATE_LINK_BYTES_PER_S``; attention is priced for the first
    batch's sequence length (``cost.attention_blocks``). The same rule applied to a shape's layers:
    the layers before ``costs.decoder_layers`` are the embedding (a lookup: no matmul parameters),
    every other layer's active parameters are matmul parameters (a norm's few weights are counted
    too: under 1e-4 of a layer), the decoder layers (``costs.decoder_layers``) add
    ``attention_flops_per_token`` (``attention_flops_per_token([(q_dim, None)], seq_len)``: the
    simulator costs every layer's attention as full causal), and a layer's output elements are its
    output activation's. Weight, gradient and activation bytes are kept; the early-stopping recompute's saving
    (``early_stop_s``) is not: the estimate prices every layer's recompute as its forward."""
    from lightning_roundpipe.planning.keeper import ASSUMED_TOKENS_PER_MICROBATCH

    tokens = ASSUMED_TOKENS_PER_MICROBATCH
    lookups = costs.decoder_layers[0] if costs.decoder_layers is not None else 0
    decoders = range(*costs.decoder_layers) if costs.decoder_layers is not None else range(0)
    layers = []
    for index, layer in enumerate(costs.layers):
        active = layer.active_params if layer.active_params is not None else (layer.params or 0)
        matmul = 0 if index < lookups else active
        outputs = layer.act_bytes_per_token // max(1, costs.dtype_bytes)
        attention = attention_flops_per_token if index in decoders else 0.0
        forward = (2.0 * matmul + outputs + attention) * tokens / ENGINE_ESTIMATE_FLOPS_PER_S
        layers.append(replace(layer, forward_s=forward, recompute_s=forward, backward_s=2.0 * forward, early_stop_s=0.0))
    return replace(costs, layers=layers, tokens_per_microbatch=tokens, measured=False, source="estimate",
                   link_bytes_per_second=ENGINE_ESTIMATE_LINK_BYTES_PER_S)


def choose_plan(setup: Setup, costs, hardware: HardwareProfile, microbatches: int, model: str = "",
                seq_len: int | None = None) -> Plan:
    """The plan ``setup.partition`` gives (raises PlanError when it does not fit the GPU); ``"compute"``
    is searched on ``engine_estimate(costs)``, as the engine does (see ``Setup``), attention priced
    for ``seq_len``-token sequences of ``model`` (none without them)."""
    budget = int(hardware.gpu_memory_bytes * DEFAULT_MEMORY_FRACTION)
    if setup.partition == REFERENCE:
        return reference_plan(model)
    if setup.partition == PLANNER:
        choice = best_plan(costs, hardware, [microbatches], fused_last=True)
        if choice is None:
            raise PlanError("no candidate plan fits the GPU memory")
        return choice.plan
    if setup.partition == "compute":
        attention = (attention_flops_per_token([(get_model_shape(model).q_dim, None)], seq_len)
                     if model and seq_len else 0.0)
        return partition("compute", engine_estimate(costs, attention), hardware.num_gpus, microbatches, memory_budget_bytes=budget,
                         link_bytes_per_second=ENGINE_ESTIMATE_LINK_BYTES_PER_S, fused_last=True)
    return partition(setup.partition, costs, hardware.num_gpus, microbatches, memory_budget_bytes=budget,
                     link_bytes_per_second=hardware.host_device_bytes_per_s, fused_last=True)


def simulate_setup(run: PublishedRun, hardware: str | HardwareProfile, setup: Setup, *,
                   optimizer_steps: int = 3, seq_len: int | None = None,
                   adjust_costs: Callable[[CostProfile], CostProfile] | None = None,
                   plan: Plan | None = None) -> SetupResult:
    """Simulate ``setup`` on the stale-optimizer workload of ``run`` (its sequences per step).

    ``setup.microbatches`` ``ENGINE_CHOICE``: every candidate count is simulated and the
    fewest within the engine's tie tolerance of the fastest is kept, as the engine chooses.
    ``adjust_costs(costs)``: a what-if on the priced layer costs (a mechanism
    the engine does not have, such as ``exact_gap.early_stop_costs``), applied before planning.
    ``plan``: simulate this plan instead of the one ``setup.partition`` gives (``analysis/cut_search.py``)."""
    hw = load_hardware(hardware)
    if setup.microbatches == ENGINE_CHOICE:
        from lightning_roundpipe.planning.search import TIE_TOLERANCE

        tried = [simulate_setup(run, hw, replace(setup, microbatches=m), optimizer_steps=optimizer_steps,
                                seq_len=seq_len, adjust_costs=adjust_costs, plan=plan)
                 for m in microbatch_candidates(hw.num_gpus)]
        fitting = [r for r in tried if r.tokens_per_s > 0]
        if not fitting:
            return tried[0]
        fastest = max(r.tokens_per_s for r in fitting)
        chosen = min((r for r in fitting if r.tokens_per_s >= fastest / (1 + TIE_TOLERANCE)), key=lambda r: r.microbatches)
        return replace(chosen, setup=setup)  # the setup as asked; ``microbatches`` says what it chose
    work = run.stale
    m = setup.microbatches or work.microbatches
    calls = setup.calls or work.calls
    seq_len = seq_len or work.seq_len
    per_microbatch = work.sequences_per_step / (calls * m)
    costs = shape_layer_costs(get_model_shape(run.model), hw, seq_len, per_microbatch,
                              loss_chunk_tokens=setup.loss_chunk_tokens,
                              fp16_accumulation=fp16_accumulation(setup.precision), compiled_layers=setup.compiled_layers,
                              early_stop=setup.early_stop)
    if adjust_costs is not None:
        costs = adjust_costs(costs)
    if setup.compiled_layers:
        hw = compiled_launches(hw)
    try:
        plan = plan or choose_plan(setup, costs, hw, m, run.model, seq_len)
    except (PlanError, ValueError) as err:
        return SetupResult(setup, m, calls, 0.0, refused=str(err).splitlines()[0])
    need = max(roundpipe_gpu_bytes(plan, costs, hw.num_gpus))
    if need > hw.gpu_memory_bytes * DEFAULT_MEMORY_FRACTION:
        return SetupResult(setup, m, calls, 0.0, plan=plan, gpu_bytes=need,
                           refused=f"needs {need / 2**30:.1f} GiB per GPU")
    workload = replace(work, microbatches=m, calls=calls, optimizer="stale")
    result = simulate_roundpipe(plan, costs, hw, m, config=setup.sim_config(workload, optimizer_steps))
    period = optimizer_step_period(result, calls)
    return SetupResult(setup, m, calls, work.sequences_per_step * seq_len / period, result.bubble_fraction, plan,
                       need, call=result)


@dataclass
class Step:
    """One row of a waterfall: the cause switched, and the tokens/s after it."""

    cause: str
    result: SetupResult
    delta: float  # tokens/s change from the row before


def causes(hardware: HardwareProfile, reference_microbatches: int = 10) -> list[tuple[str, dict]]:
    """The switches from the reference's setup to this engine's default, in waterfall order.

    The partition policy goes last: a policy that cannot meet the memory budget refuses the run,
    and every cause before it still gets its share."""
    ours, ref = our_default(hardware), Setup()
    rows = [
        ("precision: bf16-mixed (fp32-accumulate matmuls) for fp16 with fp16 accumulation", dict(precision=ours.precision)),
        ("optimizer: exact (staleness 0) for one step stale", dict(staleness=ours.staleness)),
        ("host barriers: the next call dispatched once backward() returns"
         + (" (a step's first call; overlap_calls)" if ours.call_barrier == "step" else ""),
         dict(host_barriers=ours.host_barriers, call_barrier=ours.call_barrier)),
        ("failed-step undo: before-images copied on the optimizer lane", dict(undo=ours.undo)),
        (f"host update order: '{ours.optimizer_order}' (the optimizer lane) for '{ref.optimizer_order}'",
         dict(optimizer_order=ours.optimizer_order)),
        (f"layers: {'compiled' if ours.compiled_layers else 'eager'} (compile_layers default)"
         + (", the early-stopping recompute (recompute_early_stop default)" if ours.early_stop else ""),
         dict(compiled_layers=ours.compiled_layers, early_stop=ours.early_stop)),
        (f"microbatches: {ours.microbatches} (the default) for {reference_microbatches}", dict(microbatches=ours.microbatches)),
        (f"loss chunk: {ours.loss_chunk_tokens} tokens for {ref.loss_chunk_tokens}", dict(loss_chunk_tokens=ours.loss_chunk_tokens)),
        (f"host dispatch: {ours.dispatch_s * 1e6:.0f} us per task (CPU backend, measured)", dict(dispatch_s=ours.dispatch_s)),
        (f"host gradient accumulation on the main thread ({ours.host_accumulate_bytes_per_s / 1e9:.1f} GB/s)",
         dict(host_accumulate_bytes_per_s=ours.host_accumulate_bytes_per_s)),
        (f"partition: '{ours.partition}' policy for the planner's plan", dict(partition=ours.partition)),
    ]
    # a switch that changes nothing (layers eager, as the reference's) is left out
    return [(cause, change) for cause, change in rows if "compiled_layers" not in change or ours.compiled_layers]


def waterfall(run: PublishedRun, hardware: str | HardwareProfile, *, optimizer_steps: int = 3) -> list[Step]:
    """From the reference's setup to this engine's default, one cause at a time (all simulated)."""
    hw = load_hardware(hardware)
    setup = Setup()
    rows = [Step("reference setup (as benchmarks.validation.published_gpu)", simulate_setup(run, hw, setup,
                                                                               optimizer_steps=optimizer_steps), 0.0)]
    for cause, change in causes(hw, run.stale.microbatches):
        setup = replace(setup, **change)
        result = simulate_setup(run, hw, setup, optimizer_steps=optimizer_steps)
        rows.append(Step(cause, result, result.tokens_per_s - rows[-1].result.tokens_per_s))
    return rows


def shared_costs(run: PublishedRun, hardware: str | HardwareProfile, base: Setup, *,
                 optimizer_steps: int = 3) -> list[tuple[str, SetupResult]]:
    """What ``base`` would reach without mechanisms both designs pay in the simulation, one at a time,
    and with the two engine changes that would remove the largest of them."""
    hw = load_hardware(hardware)
    out = []
    for name, change in (("without kernel launch cost", dict(launch_s=0.0)),
                         ("next call dispatched before backward() returns", dict(call_barrier=False)),
                         ("fused last stage spread over 2 workers", dict(fused_spread=2)),
                         ("both changes", dict(call_barrier=False, fused_spread=2))):
        out.append((name, simulate_setup(run, hw, replace(base, **change), optimizer_steps=optimizer_steps)))
    return out


def best_setup(run: PublishedRun, hardware: str | HardwareProfile, *,
               microbatch_factors: tuple[float, ...] = (2, 3, 4), call_factors: tuple[float, ...] = (0.5, 1, 2),
               partitions: tuple[str, ...] | None = None, optimizer_steps: int = 3) -> list[SetupResult]:
    """The exact setups a user can choose, searched: partition policy (the default and ``auto``),
    microbatches (the default and ``microbatch_factors`` x workers) and calls per optimizer step
    (``call_factors`` x the workload's, same sequences per step), with the engine's per-call host
    work as in ``our_default``. Returns every fitting result, fastest first."""
    hw = load_hardware(hardware)
    base = our_default(hw)
    nw = hw.num_gpus
    policies = partitions or tuple(dict.fromkeys((base.partition, "auto")))
    calls0 = run.stale.calls
    results = []
    for calls in sorted({max(1, round(calls0 * f)) for f in call_factors}):
        defaults = set(microbatch_candidates(nw)) if base.microbatches == ENGINE_CHOICE else {base.microbatches}
        for m in sorted({max(1, round(nw * f)) for f in microbatch_factors} | defaults):
            for policy in policies:
                setup = replace(base, partition=policy, microbatches=m, calls=calls)
                results.append(simulate_setup(run, hw, setup, optimizer_steps=optimizer_steps))
    return sorted((r for r in results if r.tokens_per_s > 0), key=lambda r: -r.tokens_per_s)


def inexact_variants(run: PublishedRun, hardware: str | HardwareProfile, setup: Setup, *,
                     optimizer_steps: int = 3) -> list[SetupResult]:
    """``setup`` with the inexact options a user may add: staleness 1; and fp16 with fp16
    accumulation (the host loss scaler then makes the optimizer wait for every gradient)."""
    hw = load_hardware(hardware)
    return [simulate_setup(run, hw, replace(setup, staleness=1), optimizer_steps=optimizer_steps),
            simulate_setup(run, hw, replace(setup, staleness=1, precision="fp16-acc", wait_all_grads=True),
                           optimizer_steps=optimizer_steps)]


def published_run(model: str) -> PublishedRun:
    """The published run of ``model`` (``PUBLISHED_RUNS``); an unknown model is refused naming the known ones."""
    for run in PUBLISHED_RUNS:
        if run.model == model:
            return run
    raise KeyError(f"no published run for {model!r}; runs: {[r.model for r in PUBLISHED_RUNS]}")


def tasks_per_compute(plan: Plan, costs, num_workers: int, microbatches: int) -> float:
    """Tasks the engine submits per compute task for one call of ``plan`` (from the lowering)."""
    from lightning_roundpipe.cost.view import CostView
    from lightning_roundpipe.options import EngineOptions
    from lightning_roundpipe.schedule.lowering import LoweringOptions, lower
    from lightning_roundpipe.cost.graph_timing import CostSizes

    graph = lower(plan, num_workers, 0, CostSizes(CostView(costs)),
                  LoweringOptions(EngineOptions(microbatches=microbatches), fused=plan.fused_last))
    return len(graph) / sum(1 for t in graph if t.lane == "compute")


def host_limit_tokens(plan: Plan, costs, hardware: HardwareProfile, dispatch_s: float, tasks_per_compute: float,
                      num_workers: int | None = None) -> float:
    """Tokens per microbatch below which one host process cannot keep the workers busy.

    Per microbatch the host submits ``tasks_per_compute`` tasks for each of the plan's compute
    tasks (``dispatch_s`` each) and issues each compute task's kernels
    (``launch_seconds`` of its decoder
    layers); the workers together compute the microbatch's stages in their total time over
    ``num_workers``. The host is the limit when its time exceeds theirs:
    ``tokens < num_workers * host_s / device_s_per_token``, with ``costs`` timed for
    ``costs.tokens_per_microbatch`` tokens (compute is taken as linear in tokens).
    """
    from lightning_roundpipe.cost.view import CostView

    view = CostView(costs)
    nw = num_workers or hardware.num_gpus
    span = costs.decoder_layers
    stages = [(s, "forward") for s in plan.forward_stages()]
    stages += [(s, "backward") for s in plan.dispatched_backward_stages()]
    if plan.fused_last:
        stages[len(plan.forward) - 1] = (stages[len(plan.forward) - 1][0], "fused")
    device_s = host_s = 0.0
    for stage, kind in stages:
        a, b = stage.start, stage.end
        device_s += {"forward": view.forward_s, "fused": view.fused_s, "backward": view.backward_with_recompute_s}[kind](a, b)
        layers = max(0, min(b, span[1]) - max(a, span[0])) if span is not None else 0
        host_s += tasks_per_compute * dispatch_s + hardware.launch_seconds(kind, layers)
    return nw * host_s / (device_s / costs.tokens_per_microbatch)
