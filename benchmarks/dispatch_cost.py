"""Host time per submitted task on the CPU backend, and where one Python process becomes the limit.

    python -m benchmarks.dispatch_cost [--workers 2] [--tasks 20000]

One process submits every task of every worker (the engine's dispatch). This submits
``--tasks`` no-op compute tasks round-robin to a running :class:`CpuWorkerPool`, each
depending on the one before on its worker (as a stage's microbatches do), and reports the
host seconds per submission (best of five rounds, workers running meanwhile). It then says, for
the task graph of a RoundPipe step (tasks per compute task from the lowering), the compute-task
size below which the host's submissions take longer than the workers' compute: with ``n``
workers and ``k`` tasks per compute task the host needs ``n * k * dispatch_s`` per round of
computes, so computes shorter than that leave the workers waiting for the host.
"""

from __future__ import annotations

import argparse
import time

from lightning_roundpipe.schedule.lowering import LoweringOptions, lower
from lightning_roundpipe.sim.simulate import CostSizes
from lightning_roundpipe.cost.view import CostView
from lightning_roundpipe.planning.balanced import balanced_plan
from lightning_roundpipe.workers.completions import TaskLabel
from lightning_roundpipe.workers.cpu import CpuWorkerPool


def seconds_per_submission(workers: int, tasks: int, rounds: int = 5) -> float:
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


def tasks_per_compute(num_layers: int = 28, workers: int = 8, microbatches: int = 10) -> float:
    """Tasks a RoundPipe step submits per compute task (a 3-stages-per-worker plan, from the lowering)."""
    from lightning_roundpipe.cost.profile import CostProfile, LayerCost
    costs = CostProfile([LayerCost(1.0, 1.0, 2.0, 100, 100, 10) for _ in range(num_layers)], tokens_per_microbatch=1)
    plan = balanced_plan(costs, 3 * workers, fused_last=True)
    graph = lower(plan, workers, 0, CostSizes(CostView(costs)), LoweringOptions(microbatches=microbatches, fused=True))
    computes = sum(1 for t in graph if t.lane == "compute")
    return len(graph) / computes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=20000)
    args = parser.parse_args(argv)
    d = seconds_per_submission(args.workers, args.tasks)
    k = tasks_per_compute()
    print(f"host time per submitted task: {d * 1e6:.1f} us ({args.workers} CPU workers, {args.tasks} tasks, best of 5)")
    print(f"tasks per compute task in a RoundPipe step (28 layers, 24 stages, 10 microbatches): {k:.2f}")
    for n in (1, 2, 4, 8, 16):
        print(f"  {n:>2} workers: the host limits when a compute task is shorter than {n * k * d * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
