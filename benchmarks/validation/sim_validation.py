"""Does the simulator predict the engine? Measured CPU-backend steps against ``simulate_roundpipe``.

The CPU backend is made to behave like a machine whose numbers are known:

- every compute task (one stage, one microbatch) sleeps ``delay_s`` before it runs, and the
  layers are tiny ``nn.Linear`` s, so a task costs about ``delay_s``;
- every transfer sleeps ``latency_s + bytes / bandwidth_bytes_per_s`` (the modelled link).

The simulator gets the same plan (the one the runtime ran in the timed steps), the same
microbatch count, a :class:`~lightning_roundpipe.cost.hardware.HardwareProfile` with the same link, and a
:class:`~lightning_roundpipe.cost.profile.CostProfile` whose times reproduce the injected delays. The
backend sleeps once per compute *task*, not per layer, so the delay is put on the first layer of
every stage (forward times on the first layer of each forward stage, recompute + backward on the
first layer of each backward stage) and the other layers cost nothing. Bytes are the real
weight, gradient and activation sizes.

Three predictions per case:

- ``sim``: ``simulate_roundpipe`` with the costs above and its defaults, which include the
  engine's two host barriers (``SimConfig.host_barriers``: backward is dispatched by
  ``loss.backward()`` once the whole forward output is home; the next step once ``backward()``
  returned). This is what one knows beforehand;
- ``sim, measured task times``: the same with each stage's compute time replaced by the median
  measured duration of its compute tasks (delay plus real compute and lane overhead), so what
  remains is the scheduling and transfer model;
- ``sim, no host barriers``: ``SimConfig(host_barriers=False)``, each microbatch's backward
  starting on its own output gradient: what an engine that started backward per microbatch
  could reach, not what this one runs.

The measured step is the median wall-clock time of a training step (pipelined forward, loss on
the host, pipelined backward, SGD step); the traced step (first task start to last task end) is
shown too: their difference is host work between the pipeline's tasks, which the simulator does
not model. The host optimizer is left out of the simulation (plain PyTorch runs SGD after
backward, and it takes well under a millisecond here).

    python -m benchmarks.validation.sim_validation [--json out.json] [--quick]   # or: python benchmarks/validation/sim_validation.py
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from lightning_roundpipe.options import PartitionConfig, TransferConfig
from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.runtime import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.cost.hardware import HardwareProfile
from lightning_roundpipe.sim import SimConfig, SimResult, simulate_roundpipe

if __package__:
    from benchmarks.harness import cli, load_line, markdown_table, run_info, write_json
else:  # run as a file (python benchmarks/validation/sim_validation.py): the repository root holds benchmarks/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from benchmarks.harness import cli, load_line, markdown_table, run_info, write_json


@dataclass(frozen=True)
class Case:
    """One measured configuration.

    policy: "uniform", "auto", or "single" (one layer per stage in both directions, as a manual plan).
    """

    name: str
    policy: str
    microbatches: int


@dataclass
class ValidationConfig:
    """The model, the injected machine and the cases.

    width / layers / head_width: ``layers - 1`` x ``Linear(width, width)`` then ``Linear(width,
        head_width)`` (a wider last layer, so its weights take longer on the link).
    batch: rows per step (split into each case's microbatches).
    delay_s: injected sleep per compute task. bandwidth_bytes_per_s / latency_s: the link.
    workers: CPU workers. warmup / steps: untimed and timed steps per case.
    """

    width: int = 256
    layers: int = 6
    head_width: int = 1024
    batch: int = 32
    delay_s: float = 0.015
    bandwidth_bytes_per_s: float = 50e6
    latency_s: float = 5e-4
    workers: int = 2
    warmup: int = 9
    steps: int = 6
    seed: int = 0
    cases: tuple = (
        Case("uniform, 4 mb", "uniform", 4),
        Case("uniform, 8 mb", "uniform", 8),
        Case("auto, 8 mb", "auto", 8),
        Case("one layer per stage, 4 mb", "single", 4),
    )

    def as_dict(self) -> dict:
        return asdict(self)


def quick_config() -> ValidationConfig:
    """A few-second version for smoke tests (shorter delay, fewer steps and cases)."""
    return ValidationConfig(width=64, head_width=256, batch=8, delay_s=0.004, bandwidth_bytes_per_s=20e6,
                            latency_s=2e-4, warmup=2, steps=3,
                            cases=(Case("uniform, 4 mb", "uniform", 4), Case("one layer per stage, 2 mb", "single", 2)))


# ------------------------------------------------------------------ model and costs
def build_model(cfg: ValidationConfig) -> nn.Sequential:
    """Tiny linear layers: real compute is negligible next to the injected delay."""
    torch.manual_seed(cfg.seed)
    widths = [cfg.width] * cfg.layers + [cfg.head_width]
    return nn.Sequential(*[nn.Linear(widths[i], widths[i + 1]) for i in range(cfg.layers)])


def param_bytes(layer: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def task_costs(plan: Plan, model: nn.Sequential, cfg: ValidationConfig, microbatches: int,
               forward_s: dict[str, float], backward_s: dict[str, float]) -> CostProfile:
    """A CostProfile that charges each stage's compute once per microbatch, on its first layer.

    ``forward_s`` / ``backward_s`` map stage names ("F0", "B2") to seconds per compute task
    (backward: recompute + backward, one task). Bytes are the layers' real fp32 sizes.
    """
    fwd = [0.0] * len(model)
    bwd = [0.0] * len(model)
    for stage in plan.forward_stages():
        fwd[stage.start] += forward_s[stage.name]
    for stage in plan.backward_stages():
        bwd[stage.start] += backward_s[stage.name]
    layers = []
    for i, layer in enumerate(model):
        nbytes = param_bytes(layer)
        layers.append(LayerCost(forward_s=fwd[i], recompute_s=0.0, backward_s=bwd[i], weight_bytes=nbytes,
                                grad_bytes=nbytes, act_bytes_per_token=layer.out_features * 4))
    rows = cfg.batch // microbatches  # one "token" = one row of the batch
    return CostProfile(layers, tokens_per_microbatch=rows, measured=True,
                       dtype_bytes=4, input_bytes_per_token=cfg.width * 4)


def hardware_of(cfg: ValidationConfig) -> HardwareProfile:
    """The CPU backend as a hardware profile: the injected link, an optimizer too fast to matter."""
    return HardwareProfile(
        name="cpu-backend", num_gpus=cfg.workers, tflops=0.03, gpu_memory_bytes=4 << 30,
        host_device_bytes_per_s=cfg.bandwidth_bytes_per_s, host_memory_bytes=16 << 30,
        cpu_optimizer_params_per_s=1e15, duplex=True, latency_s=cfg.latency_s,
        description="CPU backend with injected delay and link")


def partition_of(case: Case, num_layers: int) -> PartitionConfig:
    if case.policy == "single":
        ranges = [[i, i + 1] for i in range(num_layers)]
        return PartitionConfig(policy="manual", manual_forward=ranges, manual_backward=ranges)
    return PartitionConfig(policy=case.policy)


# ------------------------------------------------------------------ one case
def _median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def measure_case(case: Case, cfg: ValidationConfig) -> dict:
    """Train ``warmup + steps`` steps; return the timed steps' numbers and the plan they ran."""
    model = build_model(cfg)
    options = RuntimeOptions(
        microbatches=case.microbatches, partition=partition_of(case, cfg.layers),
        transfer=TransferConfig(bandwidth_bytes_per_s=cfg.bandwidth_bytes_per_s, latency_s=cfg.latency_s),
        testing={"compute_delay_s": cfg.delay_s}, step_metrics=True, trace_steps=cfg.warmup + cfg.steps, seed=cfg.seed)
    runtime = RoundPipeRuntime.attach(model, "cpu", cfg.workers, options)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.batch, cfg.width, generator=g)
    steps = []
    try:
        for k in range(cfg.warmup + cfg.steps):
            plan = runtime.engine.plan
            t0 = time.perf_counter()
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            wall = time.perf_counter() - t0
            if k < cfg.warmup:
                continue
            records = runtime.trace.records(runtime.kept_steps[-1])
            steps.append({"plan": plan, "wall_step_s": wall, "trace_step_s": runtime.last_metrics["step_s"],
                          "bubble_fraction": runtime.last_metrics["bubble_fraction"], "records": records})
    finally:
        runtime.detach()
    plans = list(dict.fromkeys(s["plan"].to_text() for s in steps))
    if len(plans) > 1:
        raise RuntimeError(f"case {case.name!r}: the plan changed during the timed steps ({plans}); add warm-up steps")
    per_stage: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s in steps:
        for r in s["records"]:
            if r.queue == "compute":
                per_stage[(r.kind, r.stage)].append(r.duration)
    return {
        "plan": steps[0]["plan"],
        "wall_step_s": _median(s["wall_step_s"] for s in steps),
        "trace_step_s": _median(s["trace_step_s"] for s in steps),
        "bubble_fraction": _median(s["bubble_fraction"] for s in steps),
        "wall_steps_s": [s["wall_step_s"] for s in steps],
        "task_s": {f"{kind} {stage}": _median(v) for (kind, stage), v in sorted(per_stage.items())},
        "fb_gap_s": _median(forward_backward_gap(s["records"], s["plan"]) for s in steps),
    }


def predict_case(plan: Plan, case: Case, cfg: ValidationConfig, model: nn.Sequential,
                 task_s: dict[str, float] | None = None, host_barriers: bool = True) -> SimResult:
    """Simulate ``plan`` (steady state over 4 steps).

    ``task_s`` ("forward F0" -> seconds) replaces the injected delay by measured task times;
    ``host_barriers`` is :attr:`SimConfig.host_barriers` (the engine's; False: backward per microbatch).
    """
    def seconds(kind: str, stage: str) -> float:
        return cfg.delay_s if task_s is None else task_s[f"{kind} {stage}"]

    fwd = {s.name: seconds("forward", s.name) for s in plan.forward_stages()}
    bwd = {s.name: seconds("backward", s.name) for s in plan.backward_stages()}
    costs = task_costs(plan, model, cfg, case.microbatches, fwd, bwd)
    return simulate_roundpipe(plan, costs, hardware_of(cfg), case.microbatches, num_workers=cfg.workers,
                              config=SimConfig(steps=4, host_barriers=host_barriers))


def forward_backward_gap(records, plan: Plan) -> float:
    """Seconds from the last forward output reaching the host to the first backward compute.

    Negative when backward computes start before the whole forward is home (the simulator lets
    each microbatch's backward start on its own output gradient).
    """
    last = plan.forward_stages()[-1].name
    forward_end = max(r.end for r in records if r.queue == "download" and r.kind == "act_out" and r.stage == last)
    backward_start = min(r.start for r in records if r.queue == "compute" and r.kind == "backward")
    return backward_start - forward_end


def run_validation(cfg: ValidationConfig, log=print) -> dict:
    """Measure every case, simulate it three ways, and return rows with the prediction errors."""
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    started = time.perf_counter()
    model = build_model(cfg)
    rows = []
    for case in cfg.cases:
        m = measure_case(case, cfg)
        plan = m["plan"]
        sim = predict_case(plan, case, cfg, model)
        calibrated = predict_case(plan, case, cfg, model, m["task_s"])
        free = predict_case(plan, case, cfg, model, host_barriers=False)
        wall, traced = m["wall_step_s"], m["trace_step_s"]
        row = {
            "case": case.name,
            "microbatches": case.microbatches,
            "plan": plan.to_text(),
            "measured_step_s": wall,
            "trace_step_s": traced,
            "host_gap_s": wall - traced,
            "sim_step_s": sim.step_s,
            "error": sim.step_s / wall - 1.0,
            "sim_tasks_step_s": calibrated.step_s,
            "error_tasks": calibrated.step_s / wall - 1.0,
            "sim_no_barriers_step_s": free.step_s,
            "error_no_barriers": free.step_s / wall - 1.0,
            "measured_bubble": m["bubble_fraction"],
            "sim_bubble": sim.bubble_fraction,
            "sim_no_barriers_bubble": free.bubble_fraction,
            "fb_gap_s": m["fb_gap_s"],
            "sim_fb_gap_s": forward_backward_gap([r for r in sim.timeline if r.step == 1], plan),
            "sim_no_barriers_fb_gap_s": forward_backward_gap([r for r in free.timeline if r.step == 1], plan),
            "task_overhead_s": _median(v - cfg.delay_s for v in m["task_s"].values()),
            "task_s": m["task_s"],
            "wall_steps_s": m["wall_steps_s"],
        }
        rows.append(row)
        log(f"measured {case.name}: {wall:.3f} s; simulated {sim.step_s:.3f} s ({row['error']:+.1%}), "
            f"without host barriers {free.step_s:.3f} s ({row['error_no_barriers']:+.1%})")
    return {
        "config": cfg.as_dict(),
        "rows": rows,
        **run_info(load_before, started),
    }


COLUMNS = [
    ("case", "case", "{}"),
    ("plan", "plan", "{}"),
    ("measured_step_s", "measured step s (wall)", "{:.3f}"),
    ("trace_step_s", "traced step s", "{:.3f}"),
    ("sim_step_s", "sim s", "{:.3f}"),
    ("error", "error", "{:+.1%}"),
    ("sim_tasks_step_s", "sim, measured task times s", "{:.3f}"),
    ("error_tasks", "error", "{:+.1%}"),
    ("sim_no_barriers_step_s", "sim, no host barriers s", "{:.3f}"),
    ("error_no_barriers", "error", "{:+.1%}"),
    ("measured_bubble", "bubble measured", "{:.1%}"),
    ("sim_bubble", "bubble sim", "{:.1%}"),
    ("sim_no_barriers_bubble", "bubble sim, no barriers", "{:.1%}"),
    ("fb_gap_s", "fwd-to-bwd gap s", "{:.3f}"),
    ("sim_fb_gap_s", "sim gap s", "{:.3f}"),
    ("sim_no_barriers_fb_gap_s", "sim gap, no barriers s", "{:.3f}"),
    ("task_overhead_s", "task overhead s", "{:.4f}"),
    ("host_gap_s", "host gap s", "{:.4f}"),
]


def render(result: dict) -> str:
    cfg = result["config"]
    head = (f"model: {cfg['layers'] - 1} x Linear({cfg['width']}, {cfg['width']}) + Linear({cfg['width']}, "
            f"{cfg['head_width']}), batch {cfg['batch']}, {cfg['workers']} CPU workers; injected "
            f"{cfg['delay_s'] * 1e3:g} ms per compute task, link {cfg['bandwidth_bytes_per_s'] / 1e6:g} MB/s + "
            f"{cfg['latency_s'] * 1e3:g} ms per transfer; medians of {cfg['steps']} steps after {cfg['warmup']} warm-up")
    load = load_line(result)
    rows = [dict(r, plan=r["plan"].replace("|", "\\|")) for r in result["rows"]]
    lines = []
    for key, label in (("error", "simulator (host barriers, the default)"),
                       ("error_tasks", "the same with measured task times"),
                       ("error_no_barriers", "simulator without host barriers")):
        worst = max(abs(r[key]) for r in result["rows"])
        lines.append(f"largest |error| vs wall clock, {label}: {worst:.1%} (goal: within 15%)")
    verdict = "\n".join(lines)
    return "\n".join([head, load, "", markdown_table(rows, COLUMNS), "", verdict])


def parse_args(argv=None) -> argparse.Namespace:
    p = cli(__doc__.split("\n")[0], quick="tiny and short (seconds; for smoke tests)", json_help="write the results to this JSON file")
    p.add_argument("--delay", type=float, help="injected seconds per compute task (default 0.015)")
    p.add_argument("--bandwidth", type=float, help="link bytes/s per direction (default 50e6)")
    p.add_argument("--latency", type=float, help="seconds per transfer (default 5e-4)")
    p.add_argument("--steps", type=int, help="timed steps per case")
    p.add_argument("--warmup", type=int, help="untimed steps per case")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> ValidationConfig:
    cfg = quick_config() if args.quick else ValidationConfig()
    changes = {k: v for k, v in (("delay_s", args.delay), ("bandwidth_bytes_per_s", args.bandwidth),
                                 ("latency_s", args.latency), ("steps", args.steps), ("warmup", args.warmup))
               if v is not None}
    return replace(cfg, **changes)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = "python -m benchmarks.validation.sim_validation " + shlex.join(argv)
    print("$ " + command, flush=True)
    args = parse_args(argv)
    result = run_validation(config_from_args(args))
    result["command"] = command
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    print(render(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
