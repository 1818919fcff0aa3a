"""Where a quick-size step goes beyond the model: each worker's tasks against the same work done plainly.

The CPU benchmark's quick paper-like shape without recompute (``benchmarks.peers.cpu_peers``), on
2 CPU workers, with a fixed plan (default ``0:1,1:6,6:7``, the auto plan of most runs). In one
process, side by side:

- **model**: each task priced from ``measure_layer_costs`` (the fastest of five runs of each layer
  alone, as the benchmark's model prices it): a forward stage the layers' forward, a backward stage
  their backward, the fused head both;
- **plain**: the same work as plain torch in one thread, one microbatch at a time (forward with
  autograd, then backward on its graph; the fused head forward, loss and backward); the median,
  with the allocator setting the CPU backend makes (``host_allocator.keep_freed_memory``);
- **RoundPipe**: the engine's compute tasks from its timeline (median per task kind), each
  worker role's busy time (the stages one worker ran in a step: round-robin may swap roles between
  steps), the step's phases outside the busiest role's tasks, and CPU seconds per step (``/proc``)
  of the compute threads (their busy time minus it is time spent waiting inside tasks: the GIL,
  the other threads on their core), the host thread and the lanes.

A worker's tasks add up to its busy time; the busiest sets the step. The gap between plain and
the model is what both systems pay (one layer after another is slower than one layer repeated);
the gap between RoundPipe and plain is the engine's own. Measured, not simulated.

    python -m benchmarks.figures.quick_size_gap [--plan 0:1,1:6,6:7] [--steps 30] [--rounds 2] [--workers 2] [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import defaultdict

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from benchmarks.harness import cli, cpu_seconds_by_thread_name  # noqa: E402
from benchmarks.peers.cpu_peers import SHAPES, quick_shape  # noqa: E402
from benchmarks.peers.cpu_runners import RunConfig, make_optimizer  # noqa: E402
from benchmarks.peers.models import (StageModule, build_layers, make_batch, measure_layer_costs,  # noqa: E402
                                     roundpipe_sequential, token_loss)
from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions  # noqa: E402
from lightning_roundpipe.options import PartitionConfig  # noqa: E402
from lightning_roundpipe.host.host_allocator import keep_freed_memory  # noqa: E402

WARMUP = 8


def stage_order(stage: str) -> tuple:
    """Forward stages in order, then backward stages from the last down (as a step runs them)."""
    return (stage[0] != "F", int(stage[1:]) if stage[0] == "F" else -int(stage[1:]))


def model_task_s(timings, ranges) -> dict[str, float]:
    """Per-microbatch model seconds of each task kind of the plan (``F{i}``, ``B{i}``, last one fused)."""
    out = {}
    for i, (a, b) in enumerate(ranges):
        fwd = sum(t.forward_s for t in timings[a:b])
        bwd = sum(t.backward_s for t in timings[a:b])
        if i == len(ranges) - 1:
            out[f"F{i}"] = fwd + bwd
        else:
            out[f"F{i}"], out[f"B{i}"] = fwd, bwd
    return out


def plain_task_s(shape, ranges, reps: int) -> dict[str, float]:
    """Median seconds of each task's work done plainly, one microbatch at a time, in this thread."""
    blocks, head = build_layers(shape, 0)
    x, y = make_batch(shape, 1)
    mb = shape.batch // shape.microbatches
    xs, ys = x.split(mb), y.split(mb)
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(reps):
        graphs = []
        for i, (a, b) in enumerate(ranges[:-1]):
            stage = StageModule(blocks[a:b])
            for h in xs:
                t0 = time.perf_counter()
                inp = h.detach().requires_grad_(True)
                graphs.append((i, stage(inp)))
                samples[f"F{i}"].append(time.perf_counter() - t0)
        last = len(ranges) - 1
        a, b = ranges[-1]
        fused = StageModule(blocks[a:b], head)
        for h, t in zip(xs, ys):
            t0 = time.perf_counter()
            inp = h.detach().requires_grad_(True)
            token_loss(fused(inp), t, reduction="sum").backward()
            samples[f"F{last}"].append(time.perf_counter() - t0)
        for i, out in reversed(graphs):
            t0 = time.perf_counter()
            out.backward(torch.ones_like(out))
            samples[f"B{i}"].append(time.perf_counter() - t0)
    return {k: statistics.median(v[len(v) // 4:]) for k, v in samples.items()}


def roundpipe_run(shape, ranges, steps: int, workers: int = 2) -> dict:
    """RoundPipe's step, its compute tasks (median per kind), each worker role's busy time, the step's phases
    around the busiest role and CPU seconds per step by thread (compute threads by worker, host, lanes by kind)."""
    blocks, head = build_layers(shape, 0)
    seq = roundpipe_sequential(blocks, head)
    plan = [list(r) for r in ranges]
    opts = RuntimeOptions(microbatches=shape.microbatches, recompute="never", trace_steps=WARMUP + steps + 2,
                          partition=PartitionConfig(policy="manual", manual_forward=plan, manual_backward=plan))
    rt = RoundPipeRuntime.attach(seq, "cpu", workers, opts, fused_last=True)
    try:
        rt.trace.enabled = True
        opt = make_optimizer(seq.parameters(), RunConfig())
        x, y = make_batch(shape, 1)
        batch = {"h": x, "y": y}

        now = rt.trace.now  # the timeline's clock
        marks: dict[int, tuple[float, float, float]] = {}  # step -> (start, backward returned, optimizer done)

        def step():
            t0 = now()
            opt.zero_grad(set_to_none=True)
            loss = rt.run(batch, loss_scale=1.0 / shape.tokens, tokens=shape.tokens)
            loss.backward()
            t1 = now()
            opt.step()
            marks[rt.engine.step_count] = (t0, t1, now())

        for _ in range(WARMUP):
            step()
        first = rt.engine.step_count + 1
        cpu0 = cpu_seconds_by_thread_name()
        for _ in range(steps):
            step()
        cpu1 = cpu_seconds_by_thread_name()
        wall = [marks[k][2] - marks[k][0] for k in marks if k >= first]
        tasks: dict[str, list[float]] = defaultdict(list)
        timed = [r for r in rt.trace.records() if r.queue == "compute" and r.step >= first]
        per_step: dict[tuple[int, int], list] = defaultdict(list)  # (step, worker) -> its tasks
        for r in timed:
            tasks[r.stage].append(r.end - r.start)
            per_step[(r.step, r.worker)].append(r)
        # Stages go to workers round-robin, and which worker gets which stages can change from step to
        # step: a role is the set of stages one worker ran in one step.
        busy: dict[str, list[float]] = defaultdict(list)
        for recs in per_step.values():
            role = "+".join(sorted({r.stage for r in recs}, key=stage_order))
            busy[role].append(sum(r.end - r.start for r in recs))
        seen = len({r.step for r in timed})
        # The step's time outside the busiest role's tasks: before its first task, after its last.
        crit = max(busy, key=lambda k: statistics.median(busy[k])).split("+")
        phases: dict[str, list[float]] = defaultdict(list)
        for k, (t0, t1, t2) in marks.items():
            mine = [r for r in timed if r.step == k]
            if k < first or not mine:
                continue
            c = [r for r in mine if r.stage in crit]
            phases["step start -> first compute"].append(min(r.start for r in mine) - t0)
            phases["first compute -> busiest worker's first task"].append(min(r.start for r in c) - min(r.start for r in mine))
            phases["busiest worker: first task start -> last task end"].append(max(r.end for r in c) - min(r.start for r in c))
            phases["its last task end -> last compute end"].append(max(r.end for r in mine) - max(r.end for r in c))
            phases["last compute end -> backward() returns"].append(t1 - max(r.end for r in mine))
            phases["optimizer step"].append(t2 - t1)
        cpu = defaultdict(float)  # per step: (worker, "compute") for a compute lane, "host", "upload", "download"
        for name, seconds in cpu1.items():
            role = "host" if name == "MainThread" else name.rsplit("-", 1)[-1] if name.startswith("roundpipe-w") else None
            if role is None:
                continue
            key = (int(name.split("-")[1][1:]), "compute") if role == "compute" else role
            cpu[key] += (seconds - cpu0.get(name, 0.0)) / steps
        return dict(step_s=statistics.median(wall), traced_steps=seen, tasks={k: statistics.median(v) for k, v in tasks.items()},
                    busy={k: statistics.median(v) for k, v in busy.items()}, cpu=dict(cpu),
                    phases={k: statistics.median(v) for k, v in phases.items()})
    finally:
        rt.detach()


def main(argv=None) -> int:
    p = cli(__doc__.split("\n\n")[0], quick="one round of 10 steps (about 15 s)", json_help=None)
    p.add_argument("--plan", default="0:1,1:6,6:7", help="the stages' layer ranges (the last one fused)")
    p.add_argument("--steps", type=int, default=30, help="timed RoundPipe steps per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of plain and RoundPipe, alternating")
    p.add_argument("--workers", type=int, default=2, help="CPU workers (1: no second compute thread beside the tasks)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 10
    torch.set_num_threads(1)
    # The allocator setting the CPU backend makes by default (``cpu_reuse_freed_memory``), made before the plain
    # runs too: otherwise the first round's plain head page-faults its fresh logits and RoundPipe's does not.
    keep_freed_memory()
    shape = quick_shape(SHAPES["paper"])
    ranges = [tuple(int(v) for v in r.split(":")) for r in args.plan.split(",")]
    timings = measure_layer_costs(shape)
    model = model_task_s(timings, ranges)
    m = shape.microbatches
    print(f"# quick paper-like, recompute off, plan {args.plan}, {m} microbatches, {args.workers} CPU worker(s); "
          f"load average {os.getloadavg()[0]:.2f}")
    for rnd in range(args.rounds):
        plain = plain_task_s(shape, ranges, reps=12)
        rp = roundpipe_run(shape, ranges, args.steps, args.workers)
        print(f"\n## round {rnd + 1}: RoundPipe step {rp['step_s'] * 1e3:.1f} ms (median of {args.steps}; "
              f"{rp['traced_steps']} steps' timelines)")
        print("| task | model ms | plain ms | RoundPipe ms | RoundPipe / plain |")
        print("|---|---:|---:|---:|---:|")
        for k in sorted(rp["tasks"], key=stage_order):
            print(f"| {k} | {model[k] * 1e3:.2f} | {plain[k] * 1e3:.2f} | {rp['tasks'][k] * 1e3:.2f} | "
                  f"{rp['tasks'][k] / plain[k]:.2f}x |")
        print("| a worker's tasks in a step | model ms | plain ms | RoundPipe ms (median) |")
        print("|---|---:|---:|---:|")
        for role, b in sorted(rp["busy"].items(), key=lambda kv: -kv[1]):
            stages = role.split("+")
            print(f"| {role} | {m * sum(model[k] for k in stages) * 1e3:.1f} | {m * sum(plain[k] for k in stages) * 1e3:.1f} | "
                  f"{b * 1e3:.1f} |")
        computes = sum(v for k, v in rp["cpu"].items() if isinstance(k, tuple))
        print(f"compute threads: busy {sum(rp['busy'].values()) * 1e3:.1f} ms/step, CPU {computes * 1e3:.1f} ms/step")
        print("| the step's phases (medians) | ms |")
        print("|---|---:|")
        for k, v in rp["phases"].items():
            print(f"| {k} | {v * 1e3:.2f} |")
        lanes = sum(v for k, v in rp["cpu"].items() if k in ("upload", "download"))
        print(f"host thread CPU {rp['cpu'].get('host', 0.0) * 1e3:.1f} ms/step, the four lanes {lanes * 1e3:.1f} ms/step "
              f"(CPU ticks of {1e3 / os.sysconf('SC_CLK_TCK'):.0f} ms over {args.steps} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
