"""Does the simulator predict the engine? Measured CPU-backend steps against ``simulate_roundpipe``.

The CPU backend is made to behave like a machine whose numbers are known:

- every compute task (one stage, one microbatch) sleeps ``delay_s`` before it runs, and the
  layers are tiny ``nn.Linear`` s, so a task costs about ``delay_s``;
- every transfer sleeps ``latency_s + bytes / bandwidth_bytes_per_s`` (the modelled link).

The simulator gets the same plan (the one the runtime ran in the timed steps), the same
microbatch count, a :class:`~lightning_roundpipe.sim.HardwareProfile` with the same link, and a
:class:`~lightning_roundpipe.cost.CostProfile` whose times reproduce the injected delays. The
backend sleeps once per compute *task*, not per layer, so the delay is put on the first layer of
every stage (forward times on the first layer of each forward stage, recompute + backward on the
first layer of each backward stage) and the other layers cost nothing. Bytes are the real
weight, gradient and activation sizes.

Four predictions per case:

- ``sim as shipped``: ``simulate_roundpipe`` with the costs above (what one knows beforehand);
- ``sim + host barriers``: the same, plus the engine's two host barriers when it is driven from
  plain PyTorch (:class:`HostBarrierBuilder`, a proposal for the simulator);
- ``+ release stall``: also the engine's compute-lane wait for weight-gradient downloads;
- ``same, measured task times``: each stage's compute time replaced by the median measured
  duration of its compute tasks (delay plus real compute and lane overhead), so what remains
  is the scheduling and transfer model.

The measured step is the median wall-clock time of a training step (pipelined forward, loss on
the host, pipelined backward, SGD step); the traced step (first task start to last task end) is
shown too: their difference is host work between the pipeline's tasks, which the simulator does
not model. The host optimizer is left out of the simulation (plain PyTorch runs SGD after
backward, and it takes well under a millisecond here).

    python -m benchmarks.sim_validation [--json out.json] [--quick]
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

from lightning_roundpipe.config import PartitionConfig, TransferConfig
from lightning_roundpipe.cost import CostProfile, LayerCost
from lightning_roundpipe.plan import Plan
from lightning_roundpipe.runtime import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.plan import dispatch
from lightning_roundpipe.sim import HardwareProfile, SimConfig, simulate_roundpipe
from lightning_roundpipe.sim import simulate as sim_internals
from lightning_roundpipe.sim.costview import CostView
from lightning_roundpipe.sim.events import HOST, EventSimulator, Op

from .report import markdown_table, write_json


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
                       notes={"dtype_bytes": 4, "input_bytes_per_token": cfg.width * 4})


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
        cpu_compute_delay_s=cfg.delay_s, step_metrics=True, trace_steps=cfg.warmup + cfg.steps, seed=cfg.seed)
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


class HostBarrierBuilder(sim_internals._RoundPipeBuilder):
    """The simulator's RoundPipe step plus the two host barriers of the engine run from plain PyTorch.

    A proposal for ``lightning_roundpipe.sim`` (it builds on that module's private builder, so
    it lives here until the simulator grows an option for it):

    - **forward/backward**: the host computes the loss only once every microbatch's output is
      home, and ``loss.backward()`` is what dispatches the backward stages. So no backward input
      upload and no backward-stage weight upload starts before the whole forward is on the host.
    - **step to step**: the next step is dispatched when ``backward()`` has returned, i.e. once
      every weight gradient is home (and the optimizer step, here free, is done); nothing of step
      s+1 (not even its first weight upload) overlaps step s.

    With ``release_stall`` it also models what the engine does today when a backward stage ends:
    the task that frees the stage's weights sits on the worker's in-order compute lane and waits
    for the weight-gradient download, so the worker's next compute waits for it as well.

    ``host_loss_s`` / ``host_step_s`` are host seconds spent at the two barriers (0: unknown).
    Only for plans without a fused last stage.
    """

    host_loss_s = 0.0
    host_step_s = 0.0
    release_stall = False
    step_done: Op | None = None  # the host op after which the next step is dispatched

    def step(self, step: int) -> None:
        if self.plan.fused_last:
            raise ValueError("HostBarrierBuilder models the host loss of a plan without a fused last stage")
        tasks = dispatch(self.plan, self.nw, self.first_worker)
        if self.cfg.continue_round_robin:
            self.first_worker = (self.first_worker + len(tasks)) % self.nw
        self.act_src, self.grad_src, self.wgrads = {}, {}, []
        n_layers, n_forward = self.plan.num_layers, len(self.plan.forward)
        previous = self.step_done
        if previous is not None:  # step s+1 is dispatched after step s returned
            for i in range(self.m):
                self.act_src[(0, i)] = previous
            self.optim_prev = {layer: self.optim_prev.get(layer, []) + [previous] for layer in range(n_layers)}
        for task in tasks[:n_forward]:
            self._task(task.stage, task.worker, step)
        outputs = [self.act_src[(n_layers, i)] for i in range(self.m)]
        loss = self.add(Op(HOST, "host", "loss", "", -1, step, seconds=self.host_loss_s, deps=outputs))
        # loss.backward() dispatches the backward: everything it uploads waits for the loss.
        self.act_src = {key: loss for key in self.act_src}
        self.grad_src = {(n_layers, i): loss for i in range(self.m)}
        self.optim_prev = {layer: self.optim_prev.get(layer, []) + [loss] for layer in range(n_layers)}
        for task in tasks[n_forward:]:
            self._task(task.stage, task.worker, step)
            if self.release_stall:
                # The engine frees a stage's weights with a task on the worker's in-order compute
                # lane that waits for the weight-gradient download: the worker's next compute
                # waits for that download too. (Compute n waits for the outputs of compute n-2.)
                wgrads = self.releases[task.worker][-1][1:]
                for downloads in self.outputs[task.worker][-2:]:
                    downloads.extend(wgrads)
        by_layer: dict[int, list[Op]] = {}
        for layer, op in self.wgrads:
            by_layer.setdefault(layer, []).append(op)
        self.optim_prev = sim_internals.add_optimizer(self.sim, by_layer, self.view, self.hw, self.cfg, step)
        updates = [op for ops in self.optim_prev.values() for op in ops]
        self.step_done = self.add(Op(HOST, "host", "step", "", -1, step, seconds=self.host_step_s,
                                     deps=[op for _, op in self.wgrads] + updates))


def simulate_with_host_barriers(plan: Plan, costs: CostProfile, hardware: HardwareProfile, microbatches: int,
                                num_workers: int, config: SimConfig | None = None, release_stall: bool = False):
    """``simulate_roundpipe`` with :class:`HostBarrierBuilder` in place of the shipped builder."""
    cfg = config or SimConfig()
    plan.validate()
    view = CostView(costs)
    sim = EventSimulator(sim_internals.link_of(hardware, cfg))
    builder = HostBarrierBuilder(sim, plan, view, hardware, microbatches, num_workers, cfg)
    builder.release_stall = release_stall
    for step in range(cfg.steps):
        builder.step(step)
    sim.run()
    return sim_internals.summarize(sim, "roundpipe+host-barriers", num_workers, microbatches, view.tokens, cfg.steps)


def predict_case(plan: Plan, case: Case, cfg: ValidationConfig, model: nn.Sequential,
                 task_s: dict[str, float] | None = None, barriers: bool = False, release_stall: bool = False):
    """Simulate ``plan`` (steady state over 4 steps).

    ``task_s`` ("forward F0" -> seconds) replaces the injected delay by measured task times;
    ``barriers`` adds the engine's host barriers and ``release_stall`` its compute-lane wait for
    gradient downloads (:class:`HostBarrierBuilder`).
    """
    def seconds(kind: str, stage: str) -> float:
        return cfg.delay_s if task_s is None else task_s[f"{kind} {stage}"]

    fwd = {s.name: seconds("forward", s.name) for s in plan.forward_stages()}
    bwd = {s.name: seconds("backward", s.name) for s in plan.backward_stages()}
    costs = task_costs(plan, model, cfg, case.microbatches, fwd, bwd)
    sim_cfg = SimConfig(steps=4)
    if barriers:
        return simulate_with_host_barriers(plan, costs, hardware_of(cfg), case.microbatches, cfg.workers, sim_cfg,
                                           release_stall=release_stall)
    return simulate_roundpipe(plan, costs, hardware_of(cfg), case.microbatches, num_workers=cfg.workers,
                              config=sim_cfg)


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
    """Measure every case, simulate it four ways, and return rows with the prediction errors."""
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    started = time.perf_counter()
    model = build_model(cfg)
    rows = []
    for case in cfg.cases:
        m = measure_case(case, cfg)
        plan = m["plan"]
        shipped = predict_case(plan, case, cfg, model)
        barrier = predict_case(plan, case, cfg, model, barriers=True)
        engine_like = predict_case(plan, case, cfg, model, barriers=True, release_stall=True)
        calibrated = predict_case(plan, case, cfg, model, m["task_s"], barriers=True, release_stall=True)
        wall, traced = m["wall_step_s"], m["trace_step_s"]
        row = {
            "case": case.name,
            "microbatches": case.microbatches,
            "plan": plan.to_text(),
            "measured_step_s": wall,
            "trace_step_s": traced,
            "host_gap_s": wall - traced,
            "sim_step_s": shipped.step_s,
            "error": shipped.step_s / wall - 1.0,
            "sim_barrier_step_s": barrier.step_s,
            "error_barrier": barrier.step_s / wall - 1.0,
            "sim_engine_step_s": engine_like.step_s,
            "error_engine": engine_like.step_s / wall - 1.0,
            "sim_tasks_step_s": calibrated.step_s,
            "error_tasks": calibrated.step_s / wall - 1.0,
            "measured_bubble": m["bubble_fraction"],
            "sim_bubble": shipped.bubble_fraction,
            "sim_barrier_bubble": barrier.bubble_fraction,
            "fb_gap_s": m["fb_gap_s"],
            "sim_fb_gap_s": forward_backward_gap([r for r in shipped.timeline if r.step == 1], plan),
            "sim_barrier_fb_gap_s": forward_backward_gap([r for r in barrier.timeline if r.step == 1], plan),
            "task_overhead_s": _median(v - cfg.delay_s for v in m["task_s"].values()),
            "task_s": m["task_s"],
            "wall_steps_s": m["wall_steps_s"],
        }
        rows.append(row)
        log(f"measured {case.name}: {wall:.3f} s; simulated {shipped.step_s:.3f} s ({row['error']:+.1%}), "
            f"with host barriers {barrier.step_s:.3f} s ({row['error_barrier']:+.1%})")
    return {
        "config": cfg.as_dict(),
        "rows": rows,
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        "elapsed_s": time.perf_counter() - started,
        "cpus": os.cpu_count(),
    }


COLUMNS = [
    ("case", "case", "{}"),
    ("plan", "plan", "{}"),
    ("measured_step_s", "measured step s (wall)", "{:.3f}"),
    ("trace_step_s", "traced step s", "{:.3f}"),
    ("sim_step_s", "sim as shipped s", "{:.3f}"),
    ("error", "error", "{:+.1%}"),
    ("sim_barrier_step_s", "sim + host barriers s", "{:.3f}"),
    ("error_barrier", "error", "{:+.1%}"),
    ("sim_engine_step_s", "sim + barriers + release stall s", "{:.3f}"),
    ("error_engine", "error", "{:+.1%}"),
    ("sim_tasks_step_s", "same, measured task times s", "{:.3f}"),
    ("error_tasks", "error", "{:+.1%}"),
    ("measured_bubble", "bubble measured", "{:.1%}"),
    ("sim_bubble", "bubble sim", "{:.1%}"),
    ("sim_barrier_bubble", "bubble sim + barriers", "{:.1%}"),
    ("fb_gap_s", "fwd-to-bwd gap s", "{:.3f}"),
    ("sim_fb_gap_s", "sim gap s", "{:.3f}"),
    ("sim_barrier_fb_gap_s", "sim + barriers gap s", "{:.3f}"),
    ("task_overhead_s", "task overhead s", "{:.4f}"),
    ("host_gap_s", "host gap s", "{:.4f}"),
]


def render(result: dict) -> str:
    cfg = result["config"]
    head = (f"model: {cfg['layers'] - 1} x Linear({cfg['width']}, {cfg['width']}) + Linear({cfg['width']}, "
            f"{cfg['head_width']}), batch {cfg['batch']}, {cfg['workers']} CPU workers; injected "
            f"{cfg['delay_s'] * 1e3:g} ms per compute task, link {cfg['bandwidth_bytes_per_s'] / 1e6:g} MB/s + "
            f"{cfg['latency_s'] * 1e3:g} ms per transfer; medians of {cfg['steps']} steps after {cfg['warmup']} warm-up")
    load = (f"load average before {result['loadavg_before'][0]:.2f}, after {result['loadavg_after'][0]:.2f} "
            f"({result['cpus']} CPUs); {result['elapsed_s']:.0f} s")
    rows = [dict(r, plan=r["plan"].replace("|", "\\|")) for r in result["rows"]]
    lines = []
    for key, label in (("error", "simulator as shipped"), ("error_barrier", "simulator + host barriers"),
                       ("error_engine", "simulator + host barriers + release stall"),
                       ("error_tasks", "the same with measured task times")):
        worst = max(abs(r[key]) for r in result["rows"])
        lines.append(f"largest |error| vs wall clock, {label}: {worst:.1%} (goal: within 15%)")
    verdict = "\n".join(lines)
    return "\n".join([head, load, "", markdown_table(rows, COLUMNS), "", verdict])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results to this JSON file")
    p.add_argument("--quick", action="store_true", help="tiny and short (seconds; for smoke tests)")
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
    command = "python -m benchmarks.sim_validation " + shlex.join(argv)
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
