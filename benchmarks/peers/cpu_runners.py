"""One training run per system, each in fresh processes (so peak RSS belongs to that run alone).

Every runner builds the same layers (``models.build_layers``, same seed), trains on the same
global batch for ``warmup + steps`` steps (forward, backward, optimizer) and reports the median
step time of the timed steps, the loss of the first step (equal across systems: they train the
same model on the same data) and memory: peak RSS of each process (``ru_maxrss``) and the peak
above the RSS right after imports ("extra": model, optimizer state, activations, copies).

- :func:`roundpipe_run`: this project, CPU backend, 2 virtual workers with one thread each, from
  plain PyTorch; the head is the fused last stage (``engine(batch, loss_scale=1/tokens)``). Every
  step, timed ones included, runs with the trace on (the lanes keep a record per task, and that cost is in
  the measured step), for each timed step's bubble fraction and the last one's time breakdown.
- :func:`torch_pipeline_run`: ``torch.distributed.pipelining`` (``Schedule1F1B`` or
  ``ScheduleGPipe``), one process per rank over gloo on 127.0.0.1, one thread per rank.
- :func:`plain_run`: one process, the whole batch at once, ``torch.set_num_threads(2)``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import resource
import socket
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from lightning_roundpipe.options import usable_cores

from .models import (
    ShapeConfig,
    StageModule,
    build_layers,
    make_batch,
    roundpipe_sequential,
    token_loss,
)


@dataclass
class RunConfig:
    """How each system is trained and timed.

    steps / warmup: timed steps and untimed warm-up steps per run; the run's step time is the
        median of the timed ones. Six warm-up steps and five timed ones by default. A process's
        first steps grow its heap to the step's high-water mark. RoundPipe's one process, with a
        thread per worker, frees and reallocates in an order that changes from step to step, so
        in some runs its heap took several steps to settle: on the paper-like shape at full size,
        steps 2-5 took up to 2.2x the settled step, with up to 19,000 page faults each at about
        35 us of system time per fault (one thread faulting a fresh 64 MiB alone: 1.4 us). In
        other runs it settled after step 1, as 1F1B's ranks did. With 2 warm-up and 3 timed steps
        that warm-up decided whole rounds (round medians 0.852 and 0.812 s against 0.481 s in one
        run; ``docs/measurements.md`` section 12). The round robin also starts each step on the
        worker after the previous step's last, so step 2 is the first in which each worker thread
        runs the other half of the stages. Five timed steps make the median stand two outliers (a
        settled run still has a step with thousands of faults now and then). Every system gets the
        same counts.
    optimizer: "adamw" (torch's fused CPU kernel) or "sgd" (momentum 0.9); lr its learning rate.
    host_threads: torch threads of RoundPipe's host thread (optimizer, gradient accumulation); None
        (default): the cores its one-thread workers leave, at least one (1 with 2 workers on 2 cores).
        More oversubscribes the workers' cores: after each of the host's parallel regions its idle
        OpenMP thread busy-waits for more work (libgomp's default spin), and with 2 workers on 2
        cores that took 11-15 ms of CPU per step of the quick paper shape from the workers on a
        quiet machine, about 100 ms (host thread and OpenMP thread each) beside one other busy
        process (``docs/measurements.md`` section 8). ``host_threads_used`` is what it runs with.
    overlap_optimizer: RoundPipe steps the optimizer layer by layer behind backward
        (``RoundPipeRuntime.overlap_optimizer``, exact) instead of after backward; None (default):
        as the runtime's default decides on this host (``RuntimeOptions.overlaps_optimizer``).
    optimizer_undo: RoundPipe keeps before-images so that a failed overlapped step is put back
        (``RuntimeOptions.optimizer_undo``, the default); False measures what that costs.
    seed: model initialisation seed (data uses seed + 1).
    timeout_s: a run that takes longer is reported as failed.
    """

    steps: int = 5
    warmup: int = 6
    optimizer: str = "adamw"
    lr: float = 1e-3
    host_threads: Optional[int] = None
    overlap_optimizer: Optional[bool] = None
    optimizer_undo: bool = True
    seed: int = 0
    timeout_s: float = 300.0

    def host_threads_used(self, workers: int) -> int:
        """The intra-op threads RoundPipe's host thread runs with beside ``workers`` one-thread workers."""
        return self.host_threads or max(1, usable_cores() - workers)


@dataclass
class RunResult:
    """What one run measured. ``error`` is set (and the numbers are empty) when it failed."""

    system: str
    recompute: bool
    step_s: float = float("nan")
    step_times_s: list = field(default_factory=list)
    first_loss: float = float("nan")
    peak_rss_mib: float = float("nan")  # largest peak RSS of the run's processes
    extra_rss_mib: float = float("nan")  # sum over processes of (peak RSS - RSS after imports)
    bubble: float | None = None  # measured from the trace (RoundPipe only)
    other_load: float = float("nan")  # cores other processes used during the timed steps
    details: dict = field(default_factory=dict)
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------ process helpers
def rss_now_bytes() -> int:
    """Resident set size of this process now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_optimizer(params, config: RunConfig) -> torch.optim.Optimizer:
    """The optimizer every system uses, over the parameters it owns."""
    params = list(params)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, fused=True)
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {config.optimizer!r}: use 'adamw' or 'sgd'")


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn_name: str, args: tuple, out_queue) -> None:
    """Entry of every spawned process: run ``fn_name(*args)`` and send back its dict (or the error)."""
    try:
        out_queue.put(("ok", globals()[fn_name](*args)))
    except BaseException:  # the parent turns this into a failed row instead of hanging
        out_queue.put(("error", traceback.format_exc()))


def _spawn_and_collect(jobs: list[tuple[str, tuple]], timeout_s: float) -> list[dict]:
    """Start one spawned process per job, return their dicts in job order; raise on error or timeout."""
    ctx = mp.get_context("spawn")
    out_queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(name, args, out_queue), daemon=True) for name, args in jobs]
    for p in procs:
        p.start()
    results, errors = [], []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"run did not finish within {timeout_s:.0f}s")
            try:
                status, payload = out_queue.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a benchmark process died with exit code {dead[0].exitcode}")
                continue
            (results if status == "ok" else errors).append(payload)
        if errors:
            raise RuntimeError(errors[0])
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return sorted(results, key=lambda r: r.get("rank", 0))


# ------------------------------------------------------------------ the runs
def system_busy_seconds() -> float:
    """CPU seconds all processes of the machine have been busy since boot (Linux /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _timed_steps(step, config: RunConfig) -> tuple[list[float], float, dict]:
    """Warm-up and timed steps; also what the machine and this process spent during the timed ones.

    ``window`` holds the wall time of the timed steps, the machine's busy CPU seconds and this
    process's CPU seconds over them: busy minus the run's own CPU is other people's load.
    """
    losses, times = [], []
    window = {}
    for i in range(config.warmup + config.steps):
        if i == config.warmup:
            window = {"wall": time.perf_counter(), "busy": system_busy_seconds(), "own": time.process_time()}
        t0 = time.perf_counter()
        loss = step()
        dt = time.perf_counter() - t0
        losses.append(float(loss))
        if i >= config.warmup:
            times.append(dt)
    window = {"wall": time.perf_counter() - window["wall"], "busy": system_busy_seconds() - window["busy"],
              "own": time.process_time() - window["own"]}
    return times, losses[0], window


def _plain_process(shape: ShapeConfig, recompute: bool, config: RunConfig) -> dict:
    torch.set_num_threads(2)
    base = rss_now_bytes()
    blocks, head = build_layers(shape, config.seed)
    model = StageModule(blocks, head, recompute=recompute)
    opt = make_optimizer(model.parameters(), config)
    x, y = make_batch(shape, config.seed + 1)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = token_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    times, first, window = _timed_steps(step, config)
    return {"times": times, "first_loss": first, "peak": peak_rss_bytes(), "base": base, "window": window}


def _roundpipe_process(shape: ShapeConfig, recompute: bool, config: RunConfig, forward, backward, workers: int,
                       partition: str) -> dict:
    torch.set_num_threads(config.host_threads_used(workers))
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
    from lightning_roundpipe.options import PartitionConfig
    from lightning_roundpipe.tracing.timeline import bubble_fraction

    base = rss_now_bytes()
    blocks, head = build_layers(shape, config.seed)
    seq = roundpipe_sequential(blocks, head)
    total_steps = config.warmup + config.steps
    if partition == "auto":
        part = PartitionConfig(policy="auto")
    else:
        part = PartitionConfig(policy="manual", manual_forward=forward, manual_backward=backward)
    options = RuntimeOptions(
        microbatches=shape.microbatches,
        recompute="always" if recompute else "never",
        partition=part,
        cpu_threads_per_worker=1,
        trace_steps=total_steps,  # keep every step's records (the default keeps only metrics)
        optimizer_undo=config.optimizer_undo,
        overlap_optimizer=config.overlap_optimizer,
    )
    overlap = options.overlaps_optimizer("cpu", workers)
    runtime = RoundPipeRuntime.attach(seq, "cpu", workers, options, fused_last=True)
    runtime.trace.enabled = True
    try:
        opt = make_optimizer(seq.parameters(), config)
        if overlap:
            # opt.step(closure): each layer's update starts once its gradient is complete, on a
            # host thread; the next forward uploads a layer once its update is done (exact).
            runtime.overlap_optimizer(opt)
        x, y = make_batch(shape, config.seed + 1)
        batch = {"h": x, "y": y}
        scale = 1.0 / shape.tokens
        phases = {"forward": [], "backward": [], "optimizer": []}
        spans = []  # (engine step, start, end) on the trace clock

        def step():
            t0 = time.perf_counter()
            s0 = runtime.trace.now()
            marks = []

            def closure():
                opt.zero_grad(set_to_none=True)
                loss = runtime.run(batch, loss_scale=scale, tokens=shape.tokens)
                marks.append(time.perf_counter())
                loss.backward()
                marks.append(time.perf_counter())
                return loss

            if overlap:
                loss = opt.step(closure)
            else:
                loss = closure()
                opt.step()
            if len(spans) == total_steps - 1:
                runtime.join()  # the last step waits for its own update: nothing is left uncounted
            t3 = time.perf_counter()
            spans.append((runtime.engine.step_count, s0, runtime.trace.now()))
            for k, v in zip(phases, (marks[0] - t0, marks[1] - marks[0], t3 - marks[1])):
                phases[k].append(v)
            return loss.detach()

        times, first, window = _timed_steps(step, config)
        timed = spans[config.warmup:]
        bubbles = [bubble_fraction(runtime.trace.records(s), workers) for s, _, _ in timed]
        last_step, s0, s1 = timed[-1]
        details = trace_breakdown(runtime.trace.records(last_step), workers, s0, s1)
        details["bubble_per_step"] = bubbles
        details["phases_median_s"] = {k: _median(v[config.warmup:]) for k, v in phases.items()}
        details["plan"] = runtime.engine.plan.to_text()
        details["partition"] = partition
        return {"times": times, "first_loss": first, "peak": peak_rss_bytes(), "base": base, "window": window,
                "bubble": _median(bubbles), "details": details}
    finally:
        runtime.detach()


def trace_breakdown(records, workers: int, step_start: float, step_end: float) -> dict:
    """Where a traced step's time went: per-worker compute busy time, task time by kind, idle gaps."""
    from lightning_roundpipe.tracing.timeline import exposed_transfer_seconds

    by_kind: dict[str, float] = {}
    busy = [0.0] * workers
    count = 0
    for r in records:
        if r.queue == "compute":
            busy[r.worker] += r.duration
            count += 1
        key = f"{r.queue}:{r.kind}"
        by_kind[key] = by_kind.get(key, 0.0) + r.duration
    compute = [r for r in records if r.queue == "compute"]
    delays = dispatch_delays(records)
    first = min((r.start for r in compute), default=step_start)
    last = max((r.end for r in compute), default=step_end)
    return {
        "step_wall_s": step_end - step_start,
        "compute_window_s": last - first,
        "before_first_compute_s": first - step_start,
        "after_last_compute_s": step_end - last,
        "compute_busy_s": busy,
        "compute_tasks": count,
        "task_seconds_by_kind": dict(sorted(by_kind.items())),
        "exposed_transfer_s": exposed_transfer_seconds(records),
        "dispatch_delay_s": {"sum": sum(delays), "max": max(delays, default=0.0), "tasks": len(delays)},
    }


def dispatch_delays(records) -> list[float]:
    """Per compute task: seconds between "could start" and "started" (engine overhead, not schedule).

    A task could start once the previous compute task on its worker ended and its own uploads on
    that worker (the stage's weights, the microbatch's input or output gradient) had ended.
    """
    uploads: dict = {}
    for r in records:
        if r.queue == "upload":
            key = (r.worker, r.stage, r.microbatch if r.kind != "weights" else -1)
            uploads[key] = max(uploads.get(key, 0.0), r.end)
    out = []
    last_end: dict = {}
    for r in sorted((r for r in records if r.queue == "compute"), key=lambda r: r.start):
        ready = max(last_end.get(r.worker, r.start), uploads.get((r.worker, r.stage, -1), 0.0),
                    uploads.get((r.worker, r.stage, r.microbatch), 0.0))
        out.append(max(0.0, r.start - ready))
        last_end[r.worker] = r.end
    return out


def _pipeline_rank(rank: int, world: int, port: int, shape: ShapeConfig, recompute: bool, config: RunConfig,
                   schedule: str, ranges) -> dict:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    base = rss_now_bytes()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        blocks, head = build_layers(shape, config.seed)
        lo, hi = ranges[rank]
        module = StageModule(blocks[lo:min(hi, shape.blocks)], head if hi > shape.blocks else None, recompute=recompute)
        del blocks, head  # layers of other ranks
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        cls = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[schedule]
        sched = cls(stage, n_microbatches=shape.microbatches, loss_fn=token_loss)
        opt = make_optimizer(module.parameters(), config)
        x, y = make_batch(shape, config.seed + 1)
        last = rank == world - 1

        def step():
            opt.zero_grad(set_to_none=True)
            losses: list = []
            if rank == 0:
                sched.step(x, return_outputs=False)
            elif last:
                sched.step(target=y, losses=losses, return_outputs=False)
            else:
                sched.step(return_outputs=False)
            opt.step()
            dist.barrier()  # a step ends when every rank is done
            return torch.stack(losses).detach().mean() if losses else torch.tensor(float("nan"))

        dist.barrier()
        times, first, window = _timed_steps(step, config)
        return {"rank": rank, "times": times, "first_loss": first, "peak": peak_rss_bytes(), "base": base,
                "window": window}
    finally:
        dist.destroy_process_group()


def _result(system: str, recompute: bool, parts: list[dict]) -> RunResult:
    times = parts[0]["times"]
    losses = [p["first_loss"] for p in parts if p["first_loss"] == p["first_loss"]]
    return RunResult(
        system=system,
        recompute=recompute,
        step_s=_median(times),
        step_times_s=times,
        first_loss=losses[0] if losses else float("nan"),
        peak_rss_mib=max(p["peak"] for p in parts) / 2**20,
        extra_rss_mib=sum(p["peak"] - p["base"] for p in parts) / 2**20,
        bubble=parts[0].get("bubble"),
        details=parts[0].get("details", {}),
        other_load=other_load_cores(parts),
    )


def other_load_cores(parts: list[dict]) -> float:
    """Average cores other processes kept busy during the run's timed steps (0 on a quiet machine).

    The machine's busy CPU time over the first process's timed window, minus the CPU time of
    the run's own processes (all ranks), per second of that window.
    """
    w = parts[0].get("window")
    if not w or w["wall"] <= 0:
        return float("nan")
    own = sum(p["window"]["own"] for p in parts if p.get("window"))
    return max(0.0, (w["busy"] - own) / w["wall"])


def _failed(system: str, recompute: bool, exc: BaseException) -> RunResult:
    return RunResult(system=system, recompute=recompute, error=f"{type(exc).__name__}: {exc}")


def plain_run(shape: ShapeConfig, recompute: bool, config: RunConfig) -> RunResult:
    """Plain PyTorch in one process, two threads, the whole batch at once."""
    try:
        parts = _spawn_and_collect([("_plain_process", (shape, recompute, config))], config.timeout_s)
        return _result("plain (1 process, 2 threads)", recompute, parts)
    except Exception as exc:  # noqa: BLE001 - reported as a failed row
        return _failed("plain (1 process, 2 threads)", recompute, exc)


def roundpipe_run(shape: ShapeConfig, recompute: bool, config: RunConfig, forward, backward, workers: int = 2,
                  partition: str = "measured") -> RunResult:
    """This project: ``workers`` CPU virtual workers (one thread each).

    ``partition="measured"`` runs the given forward/backward layer ranges (the project's
    partitioner applied to this benchmark's measured layer costs); ``"auto"`` lets the runtime
    plan from its own estimates and re-plan from what it measures.
    """
    name = f"roundpipe ({workers} CPU workers)"
    try:
        parts = _spawn_and_collect([("_roundpipe_process", (shape, recompute, config, forward, backward, workers, partition))],
                                   config.timeout_s)
        return _result(name, recompute, parts)
    except Exception as exc:  # noqa: BLE001
        return _failed(name, recompute, exc)


def torch_pipeline_run(shape: ShapeConfig, recompute: bool, config: RunConfig, schedule: str, ranges) -> RunResult:
    """torch.distributed.pipelining with ``schedule`` ("1F1B" or "GPipe"), one rank per range."""
    name = f"torch {schedule} ({len(ranges)} ranks)"
    try:
        port = _free_port()
        jobs = [("_pipeline_rank", (r, len(ranges), port, shape, recompute, config, schedule, ranges))
                for r in range(len(ranges))]
        parts = _spawn_and_collect(jobs, config.timeout_s)
        res = _result(name, recompute, parts)
        res.details["ranges"] = [list(r) for r in ranges]
        return res
    except Exception as exc:  # noqa: BLE001
        return _failed(name, recompute, exc)
