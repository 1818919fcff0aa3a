"""Partition policy and transfer queue, measured side by side on the CPU backend .

One decoder-style model with a heavy LM head (``benchmarks.peers.models``: MLP blocks of width H and a
head ``Linear(H, V)`` worth ``head_ratio`` blocks; the per-sample loss is computed inside the last
layer, so logits never cross the link), trained with plain PyTorch and SGD on 2 CPU workers of
the RoundPipe runtime, with a modelled host link (``TransferConfig.bandwidth_bytes_per_s``).

Variants (each its own copy of the model, same seed, same batch):

- ``uniform / priority`` and ``auto / priority``: the two partition policies, priority transfer
  queues (activations first, then weight prefetch, then gradients);
- ``uniform / fifo``: the uniform plan with one first-in-first-out queue per direction;
- ``auto plan / fifo``: the plan the ``auto`` variant ended its warm-up with, pinned as a manual
  plan, with FIFO queues; so both queue disciplines are compared on both partitions.

All variants warm up first (``auto`` re-plans from measurements during its first steps, at steps
1, 2, 3, 5 and 8), then run interleaved: each round runs ``steps_per_round`` steps of every
variant, in an order that rotates every round, so slow spells of a shared machine hit all of
them. Reported per variant: medians over the timed steps of the wall-clock step (forward, loss,
backward, SGD step), the traced step (first task start to last task end) and
``runtime.last_metrics``' bubble fraction and exposed transfer time.

    python -m benchmarks.figures.partition_transfer [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe.options import PartitionConfig, TransferConfig
from lightning_roundpipe.runtime import RoundPipeRuntime, RuntimeOptions

from benchmarks.peers.models import CarryBlock, LMHead, ShapeConfig, build_layers, make_batch
from benchmarks.harness import cli, load_line, markdown_table, run_info, write_json


@dataclass
class BenchConfig:
    """What is measured and for how long.

    shape: the model and batch (``benchmarks.peers.models.ShapeConfig``; the head costs ``head_ratio`` blocks).
    workers: CPU workers of the pool.
    bandwidth_bytes_per_s / latency_s: the modelled host link of every worker (per direction).
    chunk_bytes: weight uploads are cut into chunks of this size; a priority queue can slip an
        activation in only between chunks (the runtime's default, 32 MiB, is one chunk per stage here).
    warmup: untimed steps per variant before the timed rounds (``auto`` re-plans during these).
    rounds / steps_per_round: timed steps per variant = rounds x steps_per_round, interleaved.
    lr: SGD learning rate. host_threads: torch threads of the host thread (loss, SGD).
    variants: names from :data:`VARIANTS` to run (``auto plan / fifo`` needs ``auto / priority``).
    """

    shape: ShapeConfig = field(default_factory=lambda: ShapeConfig(
        "heavy-head", hidden=256, blocks=6, head_ratio=3.0, seq_len=64, batch=16, microbatches=4))
    workers: int = 2
    bandwidth_bytes_per_s: float = 1e9
    latency_s: float = 0.0
    chunk_bytes: int = 32 << 20
    warmup: int = 9
    rounds: int = 8
    steps_per_round: int = 2
    lr: float = 1e-2
    host_threads: int = 1
    seed: int = 0
    variants: tuple = ()

    def as_dict(self) -> dict:
        out = asdict(self)
        out["shape"] = self.shape.as_dict()
        return out


def quick_config() -> BenchConfig:
    """A few-second version for smoke tests: narrower, shorter, fewer steps (same structure)."""
    shape = ShapeConfig("heavy-head-quick", hidden=64, blocks=4, head_ratio=3.0, seq_len=16, batch=8, microbatches=4)
    return BenchConfig(shape=shape, warmup=4, rounds=2, steps_per_round=1)


@dataclass(frozen=True)
class Variant:
    """One configuration: partition policy and transfer queue discipline."""

    name: str
    policy: str  # "uniform", "auto", or "pinned-auto" (the auto variant's plan after warm-up, as manual)
    queue: str  # "priority" or "fifo"


VARIANTS = (
    Variant("uniform / priority", "uniform", "priority"),
    Variant("auto / priority", "auto", "priority"),
    Variant("uniform / fifo", "uniform", "fifo"),
    Variant("auto plan / fifo", "pinned-auto", "fifo"),
)


# ------------------------------------------------------------------ the model
class PerSampleLossHead(nn.Module):
    """The LM head as the pipeline's last layer: returns each sample's mean token cross-entropy.

    Computing the loss on the worker keeps the ``(tokens, V)`` logits off the link, as a real
    RoundPipe head would; the host only averages ``batch`` numbers.
    """

    def __init__(self, head: LMHead):
        super().__init__()
        self.head = head

    def forward(self, carry: dict) -> torch.Tensor:
        logits = self.head(carry["h"])
        y = carry["y"]
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")
        return per_token.view(y.shape).mean(dim=1)


def build_model(shape: ShapeConfig, seed: int = 0) -> nn.Sequential:
    """Blocks (carry ``{"h", "y"}``) and the per-sample-loss head, as the nn.Sequential to pipeline."""
    blocks, head = build_layers(shape, seed)
    return nn.Sequential(*[CarryBlock(b) for b in blocks], PerSampleLossHead(head))


# ------------------------------------------------------------------ one variant
class Contender:
    """A model copy, its runtime and optimizer; records one dict per step it runs."""

    def __init__(self, variant: Variant, cfg: BenchConfig, partition: PartitionConfig):
        self.variant = variant
        self.model = build_model(cfg.shape, cfg.seed)
        transfer = TransferConfig(bandwidth_bytes_per_s=cfg.bandwidth_bytes_per_s, latency_s=cfg.latency_s,
                                  chunk_bytes=cfg.chunk_bytes, queue=variant.queue)
        options = RuntimeOptions(microbatches=cfg.shape.microbatches, partition=partition, transfer=transfer,
                                 step_metrics=True, seed=cfg.seed)
        self.runtime = RoundPipeRuntime.attach(self.model, "cpu", cfg.workers, options)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr)
        self.steps: list[dict] = []
        self.plans_seen: list[str] = []

    def plan_text(self) -> str:
        return self.runtime.engine.plan.to_text()

    def step(self, batch: dict, timed: bool) -> dict:
        plan_before = self.plan_text()
        t0 = time.perf_counter()
        loss = self.model(batch).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        wall = time.perf_counter() - t0
        m = self.runtime.last_metrics
        record = {
            "timed": timed,
            "plan": plan_before,  # the plan this step ran (a re-plan takes effect from the next step)
            "wall_step_s": wall,
            "trace_step_s": float(m["step_s"]),
            "bubble_fraction": float(m["bubble_fraction"]),
            "exposed_transfer_s": float(m["exposed_transfer_s"]),
            "loss": float(loss.detach()),
        }
        self.steps.append(record)
        if timed and plan_before not in self.plans_seen:
            self.plans_seen.append(plan_before)
        return record

    def close(self) -> None:
        self.runtime.detach()


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(contender: Contender) -> dict:
    """Medians of the timed steps of one variant, with the plan(s) it ran."""
    timed = [s for s in contender.steps if s["timed"]]
    v = contender.variant
    row = {
        "variant": v.name,
        "policy": "auto (pinned)" if v.policy == "pinned-auto" else v.policy,
        "queue": v.queue,
        "plan": contender.plan_text(),
        "plans_timed": list(contender.plans_seen),
        "timed_steps": len(timed),
        "loss_last": timed[-1]["loss"] if timed else float("nan"),
        "steps": contender.steps,
    }
    for key in ("wall_step_s", "trace_step_s", "bubble_fraction", "exposed_transfer_s"):
        values = [s[key] for s in timed]
        row[key] = _median(values)
        row[key + "_min"] = min(values) if values else float("nan")
        row[key + "_max"] = max(values) if values else float("nan")
    return row


def comparisons(rows: list[dict]) -> list[dict]:
    """Speed-ups of the median wall-clock step: auto over uniform, priority over FIFO per partition.

    "A over B": speed-up = B's median step / A's; the differences are A's median minus B's.
    """
    by = {r["variant"]: r for r in rows}
    pairs = [
        ("auto over uniform (priority queues)", "auto / priority", "uniform / priority"),
        ("priority over FIFO (uniform plan)", "uniform / priority", "uniform / fifo"),
        ("priority over FIFO (auto plan)", "auto / priority", "auto plan / fifo"),
    ]
    out = []
    for label, fast, slow in pairs:
        if fast in by and slow in by:
            a, b = by[fast], by[slow]
            out.append({
                "comparison": label,
                "speedup": b["wall_step_s"] / a["wall_step_s"],
                "trace_speedup": b["trace_step_s"] / a["trace_step_s"],
                "bubble_change": a["bubble_fraction"] - b["bubble_fraction"],
                "exposed_change_s": a["exposed_transfer_s"] - b["exposed_transfer_s"],
            })
    return out


# ------------------------------------------------------------------ the run
def run_benchmark(cfg: BenchConfig, log=print) -> dict:
    """Warm every variant up, run the interleaved timed rounds, return rows and comparisons."""
    torch.set_num_threads(cfg.host_threads)
    names = cfg.variants or tuple(v.name for v in VARIANTS)
    variants = [v for v in VARIANTS if v.name in names]
    unknown = set(names) - {v.name for v in VARIANTS}
    if unknown:
        raise ValueError(f"unknown variant(s) {sorted(unknown)}; known: {[v.name for v in VARIANTS]}")
    if any(v.policy == "pinned-auto" for v in variants) and not any(v.policy == "auto" for v in variants):
        raise ValueError("'auto plan / fifo' pins the plan of 'auto / priority': run that variant too")
    x, y = make_batch(cfg.shape, cfg.seed + 1)
    batch = {"h": x, "y": y}
    load_before = os.getloadavg()
    started = time.perf_counter()

    contenders: list[Contender] = []
    warm_plans: dict[str, str] = {}
    try:
        # Non-pinned variants first: the pinned one copies the auto variant's plan after its warm-up.
        for v in sorted(variants, key=lambda v: v.policy == "pinned-auto"):
            if v.policy == "pinned-auto":
                source = next(c for c in contenders if c.variant.policy == "auto")
                plan = source.runtime.engine.plan
                partition = PartitionConfig(policy="manual", manual_forward=[list(r) for r in plan.forward],
                                            manual_backward=[list(r) for r in plan.backward])
            else:
                partition = PartitionConfig(policy=v.policy)
            c = Contender(v, cfg, partition)
            contenders.append(c)
            for _ in range(cfg.warmup):
                c.step(batch, timed=False)
            warm_plans[v.name] = c.runtime.describe()  # plan, dispatch and the planner's predicted costs
            log(f"warm-up done: {v.name:<20} plan {c.plan_text()}")
        contenders.sort(key=lambda c: variants.index(c.variant))
        for r in range(cfg.rounds):
            k = r % len(contenders)
            for c in contenders[k:] + contenders[:k]:  # rotate who goes first
                for _ in range(cfg.steps_per_round):
                    c.step(batch, timed=True)
        rows = [summarize(c) for c in contenders]
        # A re-plan check after the last timed step may change the plan again; that plan never ran.
        final_plans = {c.variant.name: c.plan_text() for c in contenders}
    finally:
        for c in contenders:
            c.close()
    return {
        "config": cfg.as_dict(),
        "rows": rows,
        "comparisons": comparisons(rows),
        "plans_after_warmup": warm_plans,
        "final_plans": final_plans,
        **run_info(load_before, started),
    }


COLUMNS = [
    ("variant", "variant", "{}"),
    ("plan", "plan (timed steps)", "{}"),
    ("wall_step_s", "step s (wall)", "{:.3f}"),
    ("trace_step_s", "step s (trace)", "{:.3f}"),
    ("bubble_fraction", "bubble", "{:.1%}"),
    ("exposed_transfer_s", "exposed transfer s", "{:.3f}"),
    ("timed_steps", "timed steps", "{}"),
    ("loss_last", "last loss", "{:.5f}"),
]
COMPARISON_COLUMNS = [
    ("comparison", "comparison", "{}"),
    ("speedup", "speed-up (wall)", "{:.2f}x"),
    ("trace_speedup", "speed-up (trace)", "{:.2f}x"),
    ("bubble_change", "bubble, first minus second", "{:+.1%}"),
    ("exposed_change_s", "exposed transfer s, first minus second", "{:+.3f}"),
]


def render(result: dict) -> str:
    """The markdown tables and the plans, as printed."""
    rows = []
    for r in result["rows"]:
        shown = dict(r)
        # Plan text has '|' in it; escape for markdown and flag a re-plan during timing.
        plans = r["plans_timed"] or [r["plan"]]
        shown["plan"] = " then ".join(p.replace("|", "\\|") for p in plans)
        rows.append(shown)
    cfg = result["config"]
    s = cfg["shape"]
    head = (f"model: {s['blocks']} blocks H={s['hidden']} + head V={s['vocab']} (~{s['head_ratio']:g} blocks), "
            f"{s['batch']}x{s['seq_len']} tokens, {s['microbatches']} microbatches, {cfg['workers']} CPU workers, "
            f"link {cfg['bandwidth_bytes_per_s'] / 1e9:g} GB/s + {cfg['latency_s'] * 1e6:g} us; "
            f"medians of {cfg['rounds']}x{cfg['steps_per_round']} interleaved steps after {cfg['warmup']} warm-up")
    parts = [head, load_line(result), "", markdown_table(rows, COLUMNS), "", markdown_table(result["comparisons"], COMPARISON_COLUMNS)]
    for name, text in result["plans_after_warmup"].items():
        parts += ["", f"plan of {name} after warm-up (with the planner's predicted stage costs):", text]
    return "\n".join(parts)


def parse_args(argv=None) -> argparse.Namespace:
    p = cli(__doc__.split("\n")[0], quick="a tiny model and few steps (seconds; for smoke tests)",
            json_help="write the results (every step) to this JSON file")
    p.add_argument("--bandwidth", type=float, help="link bytes/s per direction (default 1e9)")
    p.add_argument("--latency", type=float, help="seconds per transfer (default 0)")
    p.add_argument("--chunk-bytes", type=int, help="weight upload chunk size (default 32 MiB, the runtime's)")
    p.add_argument("--warmup", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps-per-round", type=int)
    p.add_argument("--variants", help="comma-separated variant names (default: all)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    cfg = quick_config() if args.quick else BenchConfig()
    changes = {k: v for k, v in (("bandwidth_bytes_per_s", args.bandwidth), ("latency_s", args.latency),
                                 ("chunk_bytes", args.chunk_bytes),
                                 ("warmup", args.warmup), ("rounds", args.rounds),
                                 ("steps_per_round", args.steps_per_round)) if v is not None}
    if args.variants:
        changes["variants"] = tuple(v.strip() for v in args.variants.split(","))
    return replace(cfg, **changes)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    print("$ python -m benchmarks.figures.partition_transfer " + shlex.join(argv), flush=True)
    args = parse_args(argv)
    result = run_benchmark(config_from_args(args))
    result["command"] = "python -m benchmarks.figures.partition_transfer " + shlex.join(argv)
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    print(render(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
