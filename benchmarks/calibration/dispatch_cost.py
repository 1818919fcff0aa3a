"""Host time per submitted task on the CPU backend, and where one Python process becomes the limit.

    python -m benchmarks.calibration.dispatch_cost [--workers 2] [--tasks 20000] [--json dispatch_cost.json]

One process submits every task of every worker (the engine's dispatch), and every lane's
thread does its bookkeeping under the same GIL. Three figures, each the best of five rounds:

- ``submit``: host seconds per ``Worker.submit`` of a no-op compute task, round-robin over
  ``--workers`` running workers, each depending on the one before on its worker (as a stage's
  microbatches do): what the main thread pays per task it submits;
- ``complete``: seconds per task a lane spends taking a ready no-op task, running it, recording
  it and setting its completion (tasks queued behind a blocker, then released): the
  completion bookkeeping, on the lane's thread;
- ``engine``: host CPU seconds (``time.process_time``: every thread of the process) of a whole
  training call of a tiny ``nn.Sequential`` (``--layers`` Linear(4, 4) layers,
  ``--microbatches`` microbatches of one row, the default partition) on ``--workers`` CPU
  workers, per task the call submits: everything the host does per task (the engine's closures,
  submissions, completions, waits, the layers' own Python and autograd, the host ``.grad``
  accumulation), since the arithmetic itself is next to nothing. Also the share spent inside
  ``Worker.submit``, and the wall time per task (with tasks this small the call is a chain of
  thread hand-offs, so wall time measures wake-up latency more than host work).

Where the host becomes the limit (the model in ``docs/reference_workload.md``): a RoundPipe call
submits ``k`` tasks per compute task (from the lowering, printed below), so with ``n`` workers
running compute tasks of ``T`` seconds each, the one process must do ``n * (k * d + L)`` of work
per ``T`` (``d`` the host seconds per task, ``L`` the host time of the task's kernel launches on
a GPU): the workers wait for the host when ``T < n * (k * d + L)``.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import cli, write_json  # noqa: E402
import torch
from torch import nn

from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.cost.view import CostView
from lightning_roundpipe.planning.balanced import balanced_plan
from lightning_roundpipe.options import EngineOptions
from lightning_roundpipe.schedule.lowering import LoweringOptions, lower
from lightning_roundpipe.cost.graph_timing import CostSizes
from lightning_roundpipe.workers.completions import TaskLabel
from lightning_roundpipe.workers.cpu import CpuWorkerPool

ROUNDS = 5


def seconds_per_submission(workers: int, tasks: int, rounds: int = ROUNDS) -> float:
    """Best host seconds per ``Worker.submit`` of a no-op compute task, over ``rounds`` rounds."""
    pool = CpuWorkerPool(workers).start()
    best = float("inf")
    try:
        for _ in range(rounds):
            last = [None] * workers
            start = time.perf_counter()
            for i in range(tasks):
                w = i % workers
                last[w] = pool.workers[w].compute(lambda: None, [last[w]], TaskLabel("forward", "F0", i, w, "compute"))
            best = min(best, (time.perf_counter() - start) / tasks)
            pool.drain()
    finally:
        pool.shutdown()
    return best


def seconds_per_completion(tasks: int, rounds: int = ROUNDS) -> float:
    """Best seconds per task one compute lane spends running no-op tasks queued behind a blocker."""
    pool = CpuWorkerPool(1).start()
    best = float("inf")
    try:
        worker = pool.workers[0]
        for _ in range(rounds):
            gate = threading.Event()
            worker.compute(gate.wait, [], TaskLabel("forward", "gate", -1, 0, "compute"))
            last = None
            for i in range(tasks):
                last = worker.compute(lambda: None, [], TaskLabel("forward", "F0", i, 0, "compute"))
            start = time.perf_counter()
            gate.set()
            last.wait(60.0)
            best = min(best, (time.perf_counter() - start) / tasks)
            pool.drain()
    finally:
        pool.shutdown()
    return best


def engine_seconds_per_task(workers: int, layers: int = 16, microbatches: int = 16,
                            rounds: int = ROUNDS) -> tuple[float, float, float, int]:
    """Per task of a training call of a tiny ``nn.Sequential`` on the CPU backend (see the module
    doc), best of ``rounds``: (host CPU seconds of all the process's threads, wall seconds, CPU
    seconds of the main thread inside ``Worker.submit``, tasks per call)."""
    from lightning_roundpipe.options import RuntimeOptions
    from lightning_roundpipe.runtime import RoundPipeRuntime

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    runtime = RoundPipeRuntime.attach(model, "cpu", workers, RuntimeOptions(microbatches=microbatches, step_metrics=False))
    counted = {"tasks": 0, "seconds": 0.0}
    for worker in runtime.pool.workers:
        submit = worker.submit

        def timed(*args, _submit=submit, **kwargs):
            start = time.perf_counter()
            try:
                return _submit(*args, **kwargs)
            finally:
                counted["seconds"] += time.perf_counter() - start
                counted["tasks"] += 1
        worker.submit = timed
    x = torch.randn(microbatches, 4)
    best = (float("inf"), 0.0, 0.0, 0)
    try:
        for _ in range(rounds + 1):  # the first call also builds host buffers
            counted.update(tasks=0, seconds=0.0)
            start, cpu = time.perf_counter(), time.process_time()
            model(x).sum().backward()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            n = counted["tasks"]
            if n and cpu / n < best[0]:
                best = (cpu / n, wall / n, counted["seconds"] / n, n)
    finally:
        runtime.detach()
    return best


def per_task_without_layers(layers_a: int, seconds_a: float, layers_b: int, seconds_b: float) -> float:
    """Host seconds per task extrapolated to no layers from two models with the same tasks (linear in layers)."""
    slope = (seconds_b - seconds_a) / (layers_b - layers_a)
    return max(0.0, seconds_a - slope * layers_a)


def tasks_per_compute(num_layers: int = 28, workers: int = 8, microbatches: int = 10) -> float:
    """Tasks a RoundPipe step submits per compute task (a 3-stages-per-worker plan, from the lowering)."""
    costs = CostProfile([LayerCost(1.0, 1.0, 2.0, 100, 100, 10) for _ in range(num_layers)], tokens_per_microbatch=1)
    plan = balanced_plan(costs, 3 * workers, fused_last=True)
    graph = lower(plan, workers, 0, CostSizes(CostView(costs)),
                  LoweringOptions(EngineOptions(microbatches=microbatches), fused=True))
    computes = sum(1 for t in graph if t.lane == "compute")
    return len(graph) / computes


def host_bound_seconds(workers: int, tasks_per_compute: float, dispatch_s: float, launch_s: float = 0.0) -> float:
    """Compute-task length below which one host process cannot keep ``workers`` workers busy:
    ``workers * (tasks_per_compute * dispatch_s + launch_s)``."""
    return workers * (tasks_per_compute * dispatch_s + launch_s)


def main(argv: list[str] | None = None) -> None:
    parser = cli(__doc__.splitlines()[0], json_help="also write the figures to this JSON file")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=20000)
    parser.add_argument("--layers", type=int, default=8, help="the smaller model; the larger has 4x as many layers")
    parser.add_argument("--microbatches", type=int, default=16)
    args = parser.parse_args(argv)
    submit = seconds_per_submission(args.workers, args.tasks)
    complete = seconds_per_completion(args.tasks)
    engine, engine_wall, engine_submit, engine_tasks = engine_seconds_per_task(args.workers, args.layers,
                                                                              args.microbatches)
    # The same tasks with 4x the layers per stage: the difference is the layers' own host work
    # (their Python and autograd: on a GPU, the kernel launches priced by launch_s), so the
    # figure extrapolated to no layers is the engine's per-task cost alone.
    more = engine_seconds_per_task(args.workers, 4 * args.layers, args.microbatches)[0]
    dispatch = per_task_without_layers(args.layers, engine, 4 * args.layers, more)
    k = tasks_per_compute()
    print(f"submit:   {submit * 1e6:6.1f} us per Worker.submit ({args.workers} CPU workers, {args.tasks} no-op tasks, "
          f"best of {ROUNDS})")
    print(f"complete: {complete * 1e6:6.1f} us per task on a lane's thread (pick, run, record, set; {args.tasks} tasks)")
    print(f"engine:   {engine * 1e6:6.1f} us of host CPU per task of a training call ({engine_submit * 1e6:.1f} us in "
          f"Worker.submit; wall {engine_wall * 1e6:.1f} us per task; {engine_tasks} tasks: {args.layers} Linear(4, 4) "
          f"layers, {args.microbatches} microbatches, {args.workers} workers)")
    print(f"          {more * 1e6:6.1f} us with {4 * args.layers} layers: {dispatch * 1e6:.1f} us per task without "
          f"the layers' own work (dispatch_s)")
    print(f"tasks per compute task in a RoundPipe step (28 layers, 24 stages, 10 microbatches): {k:.2f}")
    for n in (1, 2, 4, 8, 16):
        print(f"  {n:>2} workers: the host limits when a compute task is shorter than "
              f"{host_bound_seconds(n, k, dispatch) * 1e3:.2f} ms (without kernel launches)")
    if args.json:
        write_json(args.json, dict(workers=args.workers, submit_s=submit, complete_s=complete, engine_s=engine,
                                   engine_wall_s=engine_wall, engine_submit_s=engine_submit,
                                   engine_4x_layers_s=more, dispatch_s=dispatch, engine_tasks=engine_tasks, tasks_per_compute=k))


if __name__ == "__main__":
    main()
