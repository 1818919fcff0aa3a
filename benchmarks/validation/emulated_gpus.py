"""Eight emulated GPUs driven from one process: the engine's achieved tokens/s over the simulator's.

For Qwen3-1.7B-, Llama-3.1-8B- and Qwen3-32B-shaped models (real layer counts, width scaled to
``--hidden``) on 1, 2, 4 and 8 emulated GPUs of a hardware profile (``--profile``, rtx4090 by
default), the engine runs the reference workload (``analysis/workload.py`` PUBLISHED_RUNS:
microbatches per call, calls per optimizer step, the reference's own stage partition) on the
``emulated`` backend (``roundpipe_lab/fake_cuda/emulated.py``): the real host code throughout (dispatch, lanes,
completions, the overlapped exact optimizer with undo, gradient accumulation over calls, the
fused loss), every stream task lasting the device time the calibrated cost model gives the real
shape on the profile (in the profile's real time by default; ``--target-step-s`` or ``--time-scale``
scale every device time). The host optimizer, whose work scales with the parameter count, is
charged at the profile's host rate, and so is the undo's copy of the real shape (``--undo``); the
rest of the host work is real, on the scaled model (see docs/emulated_gpus.md). The step is driven
as Lightning's strategy drives it: the last call inside ``optimizer.step(closure)``.

Per row: achieved and simulated tokens/s (in the profile's time: wall seconds divided by the
scale), their ratio, and host CPU seconds per optimizer step per thread group (``/proc`` thread
times): the main thread (dispatch, loss, gradient accumulation), the lane threads (bookkeeping),
the stream threads (the real tensor work of the scaled model: what stands for kernel launches),
the optimizer thread (updates and undo's before-images); the process's CPU seconds per wall second
(an upper bound of the GIL's share), and lane wake-ups per second where the pool counts them.

    python -m benchmarks.validation.emulated_gpus --quick --json emulated_gpus.json   # 8 GPUs, real time, ~4-5 min
    python -m benchmarks.validation.emulated_gpus --json emulated_gpus.json           # 1, 2, 4, 8 GPUs (~45 min)
"""

from __future__ import annotations

import collections
import os
import re
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.harness import cli, cpu_seconds_by_thread_name, load_line, markdown_table, run_info, write_json
import roundpipe_lab  # noqa: F401,E402  (registers the lab's emulated backend, chosen by name below)

MODELS = ("qwen3-1.7b", "llama-3.1-8b", "qwen3-32b")
SEQ_TOKENS = 8  # tokens per sequence the scaled model really runs (the profile's time is for 2048)
COLUMNS = [("model", "model", "{}"), ("gpus", "GPUs", "{}"), ("time_scale", "scale", "{:.3f}"),
           ("simulated_tokens_per_s", "simulated tok/s", "{:,.0f}"), ("achieved_tokens_per_s", "achieved tok/s", "{:,.0f}"),
           ("achieved_over_simulated", "achieved/sim", "{:.2f}"), ("host_dispatch_s", "main s", "{:.2f}"),
           ("host_lanes_s", "lanes s", "{:.2f}"), ("host_streams_s", "streams s", "{:.2f}"),
           ("host_optimizer_s", "optim+undo s", "{:.2f}"),
           ("host_undo_s", "undo s", "{:.3f}"), ("undo_charged_s", "undo copy s", "{:.2f}"), ("host_accumulate_s", "accum s", "{:.3f}"), ("gil_share_upper_bound", "CPU/wall", "{:.2f}"),
           ("late_device_s", "launch-bound s", "{:.2f}")]


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by thread group (``/proc``)."""
    groups: dict[str, float] = collections.Counter()
    for name, seconds in cpu_seconds_by_thread_name().items():
        groups[thread_group(name)] += seconds
    return dict(groups)


def thread_group(name: str) -> str:
    """Which part of the host a thread is, by the names the pool and the optimizer give their threads."""
    if name == "MainThread":
        return "dispatch"
    if name.startswith("roundpipe-stream-"):
        return "streams"
    if re.match(r"roundpipe-w\d+-", name):
        return "lanes"
    if "optim" in name:
        return "optimizer"
    return "other"  # torch's own threads, the interpreter's


class PhaseClock:
    """Thread CPU seconds spent inside the host phases that have no thread of their own: the undo's
    before-images and commit (``StepUndo.capture`` / ``commit``, on the optimizer thread, whether
    taken ahead or at the layer's step) and the
    accumulation of downloaded gradients into ``.grad`` (``accumulate_host_grads``, on the main
    thread). Wraps those public functions while it is entered; a measurement hook, restored on exit."""

    def __init__(self) -> None:
        self.seconds = collections.Counter()
        self._lock = threading.Lock()
        self._saved: list = []

    def _wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[phase] += time.thread_time() - t0
        return timed

    def __enter__(self) -> "PhaseClock":
        from lightning_roundpipe.engine import step as engine_step
        from lightning_roundpipe.optim.step_undo import StepUndo

        for owner, name, phase in ((StepUndo, "capture", "undo"), (StepUndo, "commit", "undo"),
                                   (engine_step, "accumulate_host_grads", "accumulate")):
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(phase, original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []


class UndoCharge:
    """While entered, each before-image the undo takes (``StepUndo.capture``) also lasts
    ``seconds_per_param`` per parameter it copies (a sleep on the optimizer thread, which a real
    copy's memory traffic would keep as busy): the copy of the real shape's parameters and Adam
    moments at the profile's host rate, as the simulator prices it (``SimConfig.optimizer_undo``).
    A measurement hook, restored on exit."""

    def __init__(self, seconds_per_param: float) -> None:
        self.seconds_per_param = seconds_per_param
        self.charged_s = 0.0
        self._original = None

    def __enter__(self) -> "UndoCharge":
        from lightning_roundpipe.optim.step_undo import StepUndo

        original = self._original = StepUndo.capture
        charge = self

        def capture(undo, params):
            params = list(params)
            before = set(undo.saved)
            original(undo, params)
            copied = sum(p.numel() for p in params if id(p) in undo.saved and id(p) not in before)
            seconds = copied * charge.seconds_per_param
            if seconds > 0:
                time.sleep(seconds)
                charge.charged_s += seconds

        StepUndo.capture = capture
        return self

    def __exit__(self, *exc) -> None:
        from lightning_roundpipe.optim.step_undo import StepUndo

        StepUndo.capture = self._original


def lane_wakeups(pool):
    """The pool's lane counters so far (``WorkerPool.lane_counters()``: wake-ups, lane bookkeeping
    seconds); subtract two readings for an interval."""
    return pool.lane_counters()


def scaled_model(model: str, hidden: int):
    """A Hugging Face model of ``model``'s family and layer count, ``hidden`` wide (random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from lightning_roundpipe.cost.transformer import get_model_shape

    shape = get_model_shape(model)
    heads = 4
    cfg = dict(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=shape.num_layers,
               num_attention_heads=heads, num_key_value_heads=max(1, heads * shape.num_kv_heads // shape.num_heads),
               head_dim=hidden // heads, vocab_size=256, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    if model.startswith("llama"):
        return LlamaForCausalLM(LlamaConfig(**cfg))
    return Qwen3ForCausalLM(Qwen3Config(**cfg))


_SIMULATED: dict = {}  # (model, profile, gpus) -> simulated(): a row and its launch decision share one simulation


def engine_sim_config(workload):
    """The simulator's options for the engine on ``workload``: two optimizer steps of ``calls`` calls
    each, the optimizer lane's order (lowest layer first), SimConfig's defaults otherwise."""
    from roundpipe_lab.analysis.own_engine import ENGINE_OPTIMIZER_ORDER
    from lightning_roundpipe.sim.simulate import SimConfig

    return SimConfig(steps=2 * workload.calls, accumulation=workload.calls, optimizer_order=ENGINE_OPTIMIZER_ORDER)


def simulated(model: str, hw, gpus: int):
    """(workload, plan, costs, simulated optimizer-step seconds) of the reference workload on ``gpus``
    GPUs of ``hw`` (simulated once per model, profile and GPU count)."""
    key = (model, hw.replace(num_gpus=gpus), gpus)
    if key not in _SIMULATED:
        _SIMULATED[key] = simulate_reference(model, hw, gpus)
    return _SIMULATED[key]


def simulate_reference(model: str, hw, gpus: int):
    """``simulated`` without the cache."""
    from roundpipe_lab.analysis.workload import PUBLISHED_RUNS, optimizer_step_period, reference_plan
    from lightning_roundpipe.cost.transformer import get_model_shape, shape_layer_costs
    from lightning_roundpipe.sim.simulate import simulate_roundpipe

    w = next(r for r in PUBLISHED_RUNS if r.model == model).stale
    costs = shape_layer_costs(get_model_shape(model), hw, w.seq_len, w.sequences_per_microbatch,
                              loss_chunk_tokens=w.loss_chunk_tokens, fp16_accumulation=w.fp16_accumulation)
    plan = reference_plan(model)
    # The engine as it runs under autograd: host barriers, the exact overlapped optimizer (its lane
    # lowest layer first), one optimizer step per ``calls`` calls (SimConfig's defaults but these).
    result = simulate_roundpipe(plan, costs, hw.replace(num_gpus=gpus), w.microbatches, config=engine_sim_config(w))
    return w, plan, costs, optimizer_step_period(result, w.calls)


def run_row(model: str, gpus: int, profile: str, hidden: int, target_step_s: float | None, steps: int,
            warmup_calls: int, time_scale: float | None = None, undo: str = "charged") -> dict:
    """Train the scaled model on ``gpus`` emulated GPUs; measure ``steps`` optimizer steps. Device
    times are scaled by ``time_scale``, or (None) so that the simulated step lasts ``target_step_s``.
    ``undo``: "charged" (the before-images also take the real shape's copy time at the profile's
    host rate, ``UndoCharge``), "scaled" (only the copy of the scaled model) or "off" (no undo)."""
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.view import CostView
    from lightning_roundpipe.options import PartitionConfig
    from lightning_roundpipe.cost.task_seconds import ProfileDeviceTimes
    from lightning_roundpipe.cost.host_update import UNDO_BYTES_PER_PARAM, update_seconds

    hw = load_hardware(profile)
    w, plan, costs, sim_step_s = simulated(model, hw, gpus)
    scale = time_scale if time_scale is not None else target_step_s / sim_step_s
    net = scaled_model(model, hidden)
    options = RuntimeOptions(microbatches=w.microbatches, step_metrics=False, partition=PartitionConfig(
        policy="manual", manual_forward=[list(r) for r in plan.forward], manual_backward=[list(r) for r in plan.backward]))
    rt = RoundPipeRuntime.attach(net, "emulated", gpus, options)
    if rt.planner.plan != plan:
        raise RuntimeError(f"the engine runs {rt.planner.plan.to_text()}, the simulator {plan.to_text()}")
    scaled_bytes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in rt.layers]
    rt.pool.emulate(ProfileDeviceTimes(plan, costs, hw, scaled_bytes), time_scale=scale, duplex=hw.duplex)
    optimizer = rt.overlap_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-4), undo=undo != "off")
    # The host optimizer's time is the real parameter count at the profile's host rate (sim/simulate.py
    # add_optimizer), spread over the update units the overlapped optimizer steps.
    optimizer_s = sum(CostView(costs).trainable) / hw.optimizer_params_per_s
    optimizer.delay_per_layer_s = optimizer_s * scale / max(1, len(optimizer.unit_layers))
    trainable = sum(CostView(costs).trainable)
    undo_s = update_seconds(trainable, hw, UNDO_BYTES_PER_PARAM) - update_seconds(trainable, hw)
    scaled_params = sum(p.numel() for p in net.parameters() if p.requires_grad)
    charge = UndoCharge(undo_s * scale / scaled_params if undo == "charged" else 0.0)
    ids = torch.randint(0, net.config.vocab_size, (w.microbatches, SEQ_TOKENS), generator=torch.Generator().manual_seed(0))

    def call():
        net(input_ids=ids, labels=ids).loss.backward()

    def last_call():
        # As Lightning's strategy runs a step's last batch: inside ``optimizer.step(closure)``, its
        # backward in ``last_backward`` so that each layer steps once its gradient is complete.
        loss = net(input_ids=ids, labels=ids).loss
        with optimizer.last_backward():
            loss.backward()
        return loss

    def step():
        for _ in range(w.calls - 1):
            call()
        optimizer.step(last_call)
        optimizer.zero_grad()

    try:
        for _ in range(warmup_calls):
            call()
        optimizer.zero_grad()
        rt.join()
        before_cpu, before_wake = thread_cpu_seconds(), lane_wakeups(rt.pool)
        late_before = sum(rt.pool.late_seconds)
        with PhaseClock() as phases, charge:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            rt.join()
            rt.pool.synchronize()
            wall = (time.perf_counter() - t0) / steps
        after_cpu, after_wake = thread_cpu_seconds(), lane_wakeups(rt.pool)
        late = (sum(rt.pool.late_seconds) - late_before) / steps / gpus
    finally:
        rt.detach()
    cpu = {k: (after_cpu.get(k, 0.0) - before_cpu.get(k, 0.0)) / steps for k in after_cpu}
    achieved = w.tokens_per_step / (wall / scale)
    simulated_tps = w.tokens_per_step / sim_step_s
    return dict(
        model=model, gpus=gpus, profile=profile, sequences_per_step=w.sequences_per_step, microbatches=w.microbatches,
        calls_per_step=w.calls, time_scale=scale, simulated_step_s=sim_step_s, emulated_wall_step_s=wall,
        simulated_tokens_per_s=simulated_tps, achieved_tokens_per_s=achieved, achieved_over_simulated=achieved / simulated_tps,
        host_dispatch_s=cpu.get("dispatch", 0.0), host_lanes_s=cpu.get("lanes", 0.0),
        host_streams_s=cpu.get("streams", 0.0), host_optimizer_s=cpu.get("optimizer", 0.0),
        host_other_s=cpu.get("other", 0.0),
        # Parts of the optimizer thread's and the main thread's seconds above:
        undo=undo, undo_charged_s=charge.charged_s / steps / scale,
        host_undo_s=phases.seconds["undo"] / steps, host_accumulate_s=phases.seconds["accumulate"] / steps,
        gil_share_upper_bound=sum(cpu.values()) / wall,
        # The best ratio the host's CPU alone allows: its CPU seconds per step against the simulated
        # step (in wall seconds) times the usable cores, and times one core for GIL-serialised Python.
        host_cpu_per_step_s=sum(cpu.values()),
        cpu_bound_cores=min(1.0, (os.cpu_count() or 1) * sim_step_s * scale / max(sum(cpu.values()), 1e-9)),
        cpu_bound_gil=min(1.0, sim_step_s * scale / max(sum(cpu.values()), 1e-9)),
        lane_wakeups_per_s=(after_wake - before_wake).wakeups / (wall * steps),
        host_lane_bookkeeping_s=(after_wake - before_wake).bookkeeping_s / steps,
        late_device_s=late,
    )


LAUNCH_COLUMNS = [("model", "model", "{}"), ("profile", "profile", "{}"), ("host_issue_s_per_call", "host s/call", "{:.2f}"),
                  ("device_s_per_call", "device s/call", "{:.2f}"), ("host_over_device", "host/device", "{:.2f}"),
                  ("sim_tokens_per_s", "sim tok/s", "{:,.0f}"), ("sim_tokens_per_s_free_launches", "free launches", "{:,.0f}"),
                  ("verdict", "verdict", "{}")]


def launch_decision(row: dict, profile: str) -> dict:
    """Whether the host stays ahead of launch cost on 8 GPUs of ``profile``, from an emulated row.

    The host's CPU seconds per call of the 8-GPU row (main, lanes and streams: the work one GIL
    serialises; the streams' share is the scaled model's real tensor work, what issuing the kernels
    costs on a GPU) beside the device seconds of one call on the profile's GPUs (the simulator,
    real time), and the simulator's tokens/s with the profile's launch cost and with launches free.
    """
    from dataclasses import replace

    from roundpipe_lab.analysis.workload import optimizer_step_period
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.sim.simulate import simulate_roundpipe

    hw = load_hardware(profile).replace(num_gpus=row["gpus"])
    w, plan, costs, step_s = simulated(row["model"], hw, row["gpus"])
    config = engine_sim_config(w)
    free = simulate_roundpipe(plan, costs, hw, w.microbatches, config=replace(config, launch_s=0.0))
    free_s = optimizer_step_period(free, w.calls)
    host = (row["host_dispatch_s"] + row["host_lanes_s"] + row["host_streams_s"]) / w.calls
    device = step_s / w.calls
    verdict = ("launch-bound: per-stage CUDA graphs or compiled layers needed" if host >= device
               else f"host ahead ({device / host:.1f}x headroom)")
    return dict(model=row["model"], profile=profile, gpus=row["gpus"], host_issue_s_per_call=host,
                host_streams_s_per_call=row["host_streams_s"] / w.calls, device_s_per_call=device,
                host_over_device=host / device, sim_tokens_per_s=w.tokens_per_step / step_s,
                sim_tokens_per_s_free_launches=w.tokens_per_step / free_s, verdict=verdict)


def main(argv=None) -> dict:
    ap = cli(__doc__.split("\n")[0], quick="8 GPUs only, one measured step, in the profile's real time "
                                          "(about 4 minutes on 2 cores)")
    ap.add_argument("--profile", default="rtx4090", help="hardware profile of the emulated GPUs (cost/profiles)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--gpus", default=None, help="comma-separated GPU counts (default 1,2,4,8; --quick: 8)")
    ap.add_argument("--hidden", type=int, default=32, help="width of the scaled models")
    ap.add_argument("--target-step-s", type=float, default=None,
                    help="scale every row's device time so that one simulated optimizer step lasts this many wall "
                         "seconds (default: none, the profile's real time)")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="one scale for every row (default 1: the profile's real time)")
    ap.add_argument("--steps", type=int, default=None, help="measured optimizer steps per row (default 2; --quick: 1)")
    ap.add_argument("--undo", choices=("charged", "scaled", "off"), default="charged",
                    help="the failed-step undo's before-images: charged at the real shape's copy time (default), "
                         "only the scaled model's copy, or no undo")
    ap.add_argument("--launch-profiles", default=None,
                    help="profiles the launch-cost decision is taken for, from the 8-GPU rows (default rtx4090,h200; "
                         "--quick: rtx4090)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only add contention with the lanes
    gpus = [int(g) for g in (args.gpus or ("8" if args.quick else "1,2,4,8")).split(",")]
    target = args.target_step_s
    time_scale = args.time_scale if args.time_scale is not None or target is not None else 1.0
    steps = args.steps or (1 if args.quick else 2)
    rows, load_before, started = [], os.getloadavg(), time.perf_counter()
    for model in args.models.split(","):
        for g in gpus:
            t0 = time.perf_counter()
            row = run_row(model, g, args.profile, args.hidden, target, steps, warmup_calls=1, time_scale=time_scale,
                          undo=args.undo)
            rows.append(row)
            print(f"{model} x{g}: achieved/simulated {row['achieved_over_simulated']:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    launch_profiles = (args.launch_profiles or ("rtx4090" if args.quick else "rtx4090,h200")).split(",")
    launch = [launch_decision(row, p) for row in rows if row["gpus"] == max(gpus) for p in launch_profiles]
    info = run_info(load_before, started)
    print(markdown_table(rows, COLUMNS))
    print(markdown_table(launch, LAUNCH_COLUMNS))
    print(load_line(info))
    command = " ".join(["python -m benchmarks.validation.emulated_gpus", *(sys.argv[1:] if argv is None else argv)])
    result = dict(rows=rows, launch_decision=launch, profile=args.profile, hidden=args.hidden, target_step_s=target,
                  time_scale=time_scale, steps=steps, undo=args.undo, command=command, run=info)
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
