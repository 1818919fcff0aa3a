"""Out of the box: a new user's Lightning language model under RoundPipe's defaults, against its peers.

The model is an ``nn.Sequential`` whose first layer is an ``nn.Embedding``, then MLP decoder blocks
(``benchmarks/peers/models.py``), then a heavy LM head (``Linear`` to a vocabulary costing ``head_ratio``
blocks); ``training_step`` computes the cross-entropy from the logits on the host. Systems, each in
a fresh process, run in interleaved rounds (round 1: every system once, round 2: again, ...) so
that their ratios are side by side under the same machine load:

- ``roundpipe``: ``Trainer(strategy="roundpipe", accelerator="cpu", devices=2)``, default options;
- ``hand``: RoundPipe with the hand settings given by ``--hand`` (the best of ``--sweep``);
- ``1F1B``: ``torch.distributed.pipelining.Schedule1F1B`` on 2 gloo ranks, one thread each, its
  default settings: 4 microbatches (two per rank), layers split where the per-layer FLOPs
  balance (``cost.estimate``: the embedding a gather, the head a matmul; measured times on a
  shared machine are too noisy to split by), loss on the last rank;
- ``plain``: plain Lightning, one device, ``torch.set_num_threads(2)``.

Printed per system: median step, tokens/s and ratios to 1F1B, plain Lightning and the hand
settings; for RoundPipe runs also the plan table's predicted step, at set-up (estimated costs)
and after training (measured costs, with the host work measured), against the measured step.

    python -m benchmarks.peers.out_of_box --quick              # about 2 minutes
    python -m benchmarks.peers.out_of_box --rounds 3           # the full shape
    python -m benchmarks.peers.out_of_box --bar --systems roundpipe,1F1B --rounds 3  # issue 22's bar shape
    python -m benchmarks.peers.out_of_box --sweep --quick      # RoundPipe hand settings, each once
    python -m benchmarks.peers.out_of_box --sweep-fast --quick # the same settings in one process, plain PyTorch loop, interleaved
    python -m benchmarks.peers.out_of_box --overhead           # the CPU backend's cost per microbatch of a stage

A script, not a test: numbers depend on the machine and its load (the 1-minute load average is
printed).
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from torch import nn


from benchmarks.peers.cpu_runners import peak_rss_bytes, system_busy_seconds
from benchmarks.harness import cli, write_json
from benchmarks.peers.models import Block, LMHead, ShapeConfig

WORKERS = 2  # virtual workers / ranks / threads: the machine the issue measured on has 2 cores
SYSTEMS = ("roundpipe", "hand", "1F1B", "plain")  # and "before": RoundPipe's defaults from the tree at --before-src
# The best settings found by hand on this model (``--sweep``): the figure the defaults must come within 10% of.
HAND = {"microbatches": 4, "partition": "auto", "recompute": "never"}


@dataclass(frozen=True)
class LMShape(ShapeConfig):
    """The language model: ``Embedding(vocab, hidden)``, ``blocks`` MLP blocks, ``LMHead(hidden, vocab)``.

    The benchmark shape (:class:`~benchmarks.peers.models.ShapeConfig`: ``vocab = head_ratio * 8 *
    hidden`` makes the head's matmul cost ``head_ratio`` blocks; the embedding table holds as many
    parameters as the head, a gather though, not a matmul) plus the run's length.
    """

    name: str = "out-of-box"
    warmup: int = 3
    steps: int = 8


QUICK = LMShape(hidden=256, seq_len=64, warmup=2, steps=5)
# Issue 22's first bar: width 256, 4 microbatches (1F1B's) of 4 sequences of 128 tokens.
BAR = LMShape(name="bar", hidden=256, seq_len=128, batch=16, warmup=3, steps=6)


def build_lm(shape: LMShape, seed: int = 0) -> nn.Sequential:
    """The user's model, the same for every system (same seed)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(shape.vocab, shape.hidden), *[Block(shape.hidden) for _ in range(shape.blocks)],
                         LMHead(shape.hidden, shape.vocab))


def make_tokens(shape: LMShape, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len), generator=g)
    y = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len), generator=g)
    return x, y


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lightning_module(shape: LMShape):
    """A LightningModule as a new user writes it: the loss from the logits in ``training_step``."""
    import lightning.pytorch as pl

    class SequentialLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_lm(shape)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return lm_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return SequentialLM()


# ------------------------------------------------------------------ one run per process
def _lightning_process(shape: LMShape, system: str, options: dict, src: str | None = None) -> dict:
    if src:  # another tree's lightning_roundpipe (nothing of it is imported in this process yet)
        sys.path.insert(0, src)
    torch.set_num_threads(WORKERS)
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_roundpipe  # registers strategy="roundpipe"

    x, y = make_tokens(shape)
    total = shape.warmup + shape.steps
    data = DataLoader(TensorDataset(x.repeat(total, 1), y.repeat(total, 1)), batch_size=shape.batch)
    marks: list[float] = []
    found: dict = {}

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            marks.append(time.perf_counter())
            if batch_idx == shape.warmup:
                found["window"] = (time.perf_counter(), system_busy_seconds(), time.process_time())

        def on_train_end(self, trainer, module):
            marks.append(time.perf_counter())
            w = found.pop("window")
            found["other_load"] = max(0.0, (system_busy_seconds() - w[1] - (time.process_time() - w[2]))
                                      / (time.perf_counter() - w[0]))
            runtime = getattr(trainer.strategy, "runtime", None)
            if runtime is not None:
                runtime.join()
                plan = runtime.planner.plan
                report = runtime.planner.report()
                found.update(plan=plan.to_text(), microbatches=runtime.engine.options.microbatches,
                             recompute=runtime.options.recompute, policy=runtime.options.partition.policy,
                             setup_predicted_s=found.get("setup_predicted_s"), predicted_s=report.predicted_step_s,
                             table=report.to_table())

        def on_train_start(self, trainer, module):
            runtime = getattr(trainer.strategy, "runtime", None)
            if runtime is not None:
                found["setup_predicted_s"] = runtime.planner.report().predicted_step_s
                found["setup_table"] = runtime.planner.report().to_table()

    if system == "plain":
        strategy, devices = "auto", 1
    else:
        from lightning_roundpipe import RoundPipeStrategy

        strategy, devices = RoundPipeStrategy(**options), WORKERS
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=total, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Clock()], num_sanity_val_steps=0)
    trainer.fit(lightning_module(shape), data)
    times = [b - a for a, b in zip(marks, marks[1:])]
    return {"times": times[shape.warmup:], "peak": peak_rss_bytes(), "package": lightning_roundpipe.__file__, **found}


def _pipeline_rank(rank: int, port: int, shape: LMShape, ranges: list, microbatches: int) -> dict:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo", rank=rank, world_size=WORKERS)
    try:
        lo, hi = ranges[rank]
        module = nn.Sequential(*list(build_lm(shape))[lo:hi])
        stage = PipelineStage(module, rank, WORKERS, torch.device("cpu"))
        sched = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=lm_loss)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        x, y = make_tokens(shape)
        times = []
        dist.barrier()
        for i in range(shape.warmup + shape.steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])
            opt.step()
            dist.barrier()  # a step ends when every rank is done
            if i >= shape.warmup:
                times.append(time.perf_counter() - t0)
        return {"rank": rank, "times": times, "peak": peak_rss_bytes()}
    finally:
        dist.destroy_process_group()


def _child(fn_name: str, args: tuple, out_queue) -> None:
    try:
        out_queue.put(("ok", globals()[fn_name](*args)))
    except BaseException:  # the parent reports it instead of hanging
        out_queue.put(("error", traceback.format_exc()))


def spawn(jobs: list[tuple[str, tuple]], timeout_s: float = 600.0) -> list[dict]:
    """One spawned process per job (the environment as a new user has it); their dicts by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(name, args, out), daemon=True) for name, args in jobs]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + timeout_s
    try:
        while len(results) < len(procs):
            try:
                status, payload = out.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a run did not finish within {timeout_s:.0f}s")
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a benchmark process died")
                continue
            if status != "ok":
                raise RuntimeError(payload)
            results.append(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return sorted(results, key=lambda r: r.get("rank", 0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the 1F1B split
def flops_split(shape: LMShape) -> list[list[int]]:
    """Contiguous layer ranges per rank with balanced estimated compute (``balanced_ranges``)."""
    from lightning_roundpipe.cost.estimate import estimate_costs
    from lightning_roundpipe.planning.cuts import balanced_ranges

    costs = estimate_costs(list(build_lm(shape)), shape.seq_len, None, torch.float32)
    return [list(r) for r in balanced_ranges([c.forward_s + c.backward_s for c in costs.layers], WORKERS)]


# ------------------------------------------------------------------ runs and table
def run_system(shape: LMShape, system: str, hand: dict, ranges, before_src: str | None = None) -> dict:
    t0 = time.perf_counter()
    if system == "1F1B":
        port = free_port()
        parts = spawn([("_pipeline_rank", (r, port, shape, ranges, 4)) for r in range(WORKERS)])
        res = {"times": parts[0]["times"], "peak": max(p["peak"] for p in parts), "ranges": ranges}
    else:
        options = {"roundpipe": {}, "before": {}, "hand": hand, "plain": {}}.get(system, hand)
        src = before_src if system == "before" else None
        res = spawn([("_lightning_process", (shape, "plain" if system == "plain" else "roundpipe", options, src))])[0]
    res["wall_s"] = time.perf_counter() - t0
    return res


def median(values):
    s = sorted(values)
    n = len(s)
    return float("nan") if not n else s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def summarise(shape: LMShape, runs: dict[str, list[dict]]) -> list[dict]:
    """Per system: median step over every timed step of every round, tokens/s and the ratios."""
    rows = []
    for system, results in runs.items():
        step = median([t for r in results for t in r["times"]])
        last = results[-1]
        rows.append({"system": system, "step_s": step, "tokens_per_s": shape.tokens / step,
                     "rounds": [median(r["times"]) for r in results],
                     **{k: last.get(k) for k in ("plan", "microbatches", "recompute", "policy", "setup_predicted_s",
                                                 "predicted_s", "ranges", "other_load")}})
    tps = {r["system"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        for ref in ("1F1B", "plain", "hand"):
            r[f"vs_{ref}"] = r["tokens_per_s"] / tps[ref] if ref in tps else None
        # each run's own prediction (measured costs of that run) over that run's median step
        per_run = [res["predicted_s"] / median(res["times"]) for res in runs[r["system"]] if res.get("predicted_s")]
        r["predicted_over_measured_per_round"] = per_run
        r["predicted_over_measured"] = median(per_run) if per_run else None
    # ratios round by round: the systems of one round ran under the same load
    for r in rows:
        for ref in ("1F1B", "before"):
            if ref in runs and len(runs[ref]) == len(runs[r["system"]]):
                r[f"vs_{ref}_per_round"] = [median(b["times"]) / median(a["times"])
                                            for a, b in zip(runs[r["system"]], runs[ref])]
    return rows


def print_table(rows: list[dict]) -> None:
    def f(v, spec):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    print("| system | settings | step ms | tokens/s | vs 1F1B | vs plain | vs hand | predicted ms (setup / measured costs) | predicted / measured |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        settings = (f"M={r['microbatches']} {r['policy']} recompute={r['recompute']} {r['plan']}" if r.get("plan")
                    else f"split {r['ranges']} M=4" if r.get("ranges") else "1 device, 2 threads")
        setup = r.get("setup_predicted_s")
        pred = f"{f(setup and setup * 1e3, '.0f')} / {f(r.get('predicted_s') and r['predicted_s'] * 1e3, '.0f')}"
        print(f"| {r['system']} | {settings} | {r['step_s'] * 1e3:.0f} | {r['tokens_per_s']:.0f} | {f(r['vs_1F1B'], '.2f')} "
              f"| {f(r['vs_plain'], '.2f')} | {f(r['vs_hand'], '.2f')} | {pred} | {f(r['predicted_over_measured'], '.2f')} |")


def microbatch_overhead(layers: int = 8, rounds: int = 3, steps: int = 10) -> float:
    """Seconds one more microbatch of a stage costs on the CPU backend besides its compute:
    ``layers`` one-layer stages of ``Linear(8, 8)`` (no recompute, 2 workers, one thread), the
    median step at 8 microbatches minus the one at 2, per extra microbatch-stage (forward and
    backward), in interleaved rounds."""
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
    from lightning_roundpipe.options import PartitionConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times: dict[int, list[float]] = {2: [], 8: []}
    try:
        for _ in range(rounds):
            for m in times:
                net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
                part = PartitionConfig(policy="manual", manual_forward=[[i, i + 1] for i in range(layers)])
                runtime = RoundPipeRuntime.attach(net, "cpu", WORKERS, RuntimeOptions(
                    microbatches=m, partition=part, recompute="never", step_metrics=False))
                x = torch.randn(16, 8)
                try:
                    for i in range(steps + 2):
                        t0 = time.perf_counter()
                        net(x).sum().backward()
                        if i >= 2:
                            times[m].append(time.perf_counter() - t0)
                finally:
                    runtime.detach()
    finally:
        torch.set_num_threads(threads)
    return (median(times[8]) - median(times[2])) / (6 * 2 * layers)


def sweep_in_process(shape: LMShape, settings: list[dict], rounds: int = 3) -> dict[str, float]:
    """Median step of every setting (and the defaults, key "defaults") with the plain PyTorch loop a
    ``training_step`` amounts to (overlapped AdamW, loss from the logits on the host), the settings
    interleaved round by round in one process: ratios stay side by side under a changing load."""
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

    x, y = make_tokens(shape)
    named = {"defaults": {}, **{f"M={s['microbatches']} {s['partition']} {s['recompute']}": s for s in settings}}
    times: dict[str, list[float]] = {name: [] for name in named}
    for _ in range(rounds):
        for name, opts in named.items():
            net = build_lm(shape)
            runtime = RoundPipeRuntime.attach(net, "cpu", WORKERS, RuntimeOptions(**opts))
            opt = runtime.overlap_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-3))
            try:
                for i in range(shape.warmup + shape.steps):
                    t0 = time.perf_counter()

                    def closure():
                        opt.zero_grad()
                        loss = lm_loss(net(x), y)
                        loss.backward()
                        return loss

                    opt.step(closure)
                    if i >= shape.warmup:
                        times[name].append(time.perf_counter() - t0)
                runtime.join()
            finally:
                runtime.detach()
    return {name: median(t) for name, t in times.items()}


def sweep_settings() -> list[dict]:
    """The hand settings ``--sweep`` tries: microbatches x partition x recompute."""
    out = []
    for m, part, rec in itertools.product((2, 3, 4, 8), ("params", "auto", "compute"), ("always", "never")):
        out.append({"microbatches": m, "partition": part, "recompute": rec})
    return out


def main(argv=None) -> None:
    p = cli(__doc__.split("\n\n")[0], quick="a smaller model and fewer steps (about 2 minutes)", json_help="also write the rows here")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2 quick, 3 full)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--hand", default=json.dumps(HAND), help="the hand settings, as JSON options of RoundPipeStrategy")
    p.add_argument("--sweep", action="store_true", help="run every hand setting of sweep_settings() once instead")
    p.add_argument("--before-src", default=None,
                   help="the src/ folder of another tree (e.g. main's); adds the system 'before': its defaults")
    p.add_argument("--overhead", action="store_true", help="only measure the cost per microbatch of a stage")
    p.add_argument("--bar", action="store_true",
                   help="issue 22's bar shape: width 256, batch 16 x 128 tokens (1F1B: 4 microbatches of 4 sequences)")
    p.add_argument("--sweep-fast", action="store_true", help="the sweep in one process (plain PyTorch loop)")
    args = p.parse_args(argv)
    if args.sweep_fast:
        torch.set_num_threads(WORKERS)
        shape = BAR if args.bar else QUICK if args.quick else LMShape()
        steps = sweep_in_process(shape, sweep_settings(), rounds=args.rounds or 3)
        best = min((s for n, s in steps.items() if n != "defaults"))
        for name, s in sorted(steps.items(), key=lambda kv: kv[1]):
            print(f"{name:24s} {s * 1e3:7.0f} ms  best/this {best / s:.2f}")
        return
    if args.overhead:
        print(f"cost per microbatch of a stage: {microbatch_overhead() * 1e3:.2f} ms "
              f"(load average {os.getloadavg()[0]:.2f})")
        return
    shape = BAR if args.bar else QUICK if args.quick else LMShape()
    rounds = args.rounds or (2 if args.quick else 3)
    print(f"model: Embedding({shape.vocab}, {shape.hidden}), {shape.blocks} MLP blocks, head Linear({shape.hidden}, "
          f"{shape.vocab}) ({shape.head_ratio:g} blocks of FLOPs); batch {shape.batch} x {shape.seq_len} tokens; "
          f"{shape.warmup} warm-up + {shape.steps} timed steps; load average {os.getloadavg()[0]:.2f}", flush=True)
    ranges = flops_split(shape)
    print(f"1F1B split {ranges} (balanced estimated FLOPs)", flush=True)
    if args.sweep:
        runs = {}
        for i, opts in enumerate(sweep_settings()):
            name = f"M={opts['microbatches']} {opts['partition']} {opts['recompute']}"
            runs[name] = [run_system(shape, name, opts, ranges)]
            print(f"  {name}: {median(runs[name][0]['times']) * 1e3:.0f} ms", flush=True)
        runs["roundpipe"] = [run_system(shape, "roundpipe", {}, ranges)]
    else:
        hand = json.loads(args.hand)
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        if args.before_src and "before" not in systems:
            systems.insert(0, "before")
        runs = {s: [] for s in systems}
        for k in range(rounds):
            for s in systems:
                runs[s].append(run_system(shape, s, hand, ranges, args.before_src))
                print(f"  round {k + 1} {s}: {median(runs[s][-1]['times']) * 1e3:.0f} ms "
                      f"({runs[s][-1]['wall_s']:.0f} s wall)", flush=True)
    rows = summarise(shape, runs)
    for system in ("roundpipe", "before"):
        if system in runs and runs[system][-1].get("table"):
            print(f"\n{system} ({runs[system][-1]['package']}), plan table after training (measured costs):")
            print(runs[system][-1]["table"])
    print()
    print_table(rows)
    for r in rows:
        extra = {k: [round(v, 2) for v in r[k]] for k in ("vs_1F1B_per_round", "vs_before_per_round",
                                                          "predicted_over_measured_per_round") if r.get(k)}
        if extra:
            print(f"{r['system']}: per round {extra}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        write_json(args.json, {"shape": asdict(shape), "rows": rows})


if __name__ == "__main__":
    main()
