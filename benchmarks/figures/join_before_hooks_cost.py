"""What joining the overlapped optimizer before Lightning's post-step hooks costs (issue 20, item 3).

    python -m benchmarks.figures.join_before_hooks_cost [--steps 8] [--rounds 3] [--json out.json]

``RoundPipeStrategy.optimizer_step`` waits for every layer step before it returns, so that every
read after it (``on_train_batch_end``, an EMA or a logger over the inner model, the next
``training_step``) sees the new weights. Without that join the layer steps still running after
the closure would overlap the training loop between steps and the start of the next forward.

Side by side in one process, alternating fits (2 CPU workers, AdamW, an MLP of wide Linear+Tanh
layers): the strategy as it is ("join") against a subclass that skips the join ("no join").
Two batch sizes: a small one, where the optimizer step is most of the step (the worst case for
the join), and a larger one; each with layer steps during backward (the default) and without
(gradient clipping: every layer steps after the closure, so more is left to join). Reported: the
median step time (steps after the first two of each fit) and the ratio join / no join.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings

import lightning as L

from benchmarks.figures.tanh_mlp import TanhMLP
from benchmarks.harness import cli, write_json
import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_roundpipe import RoundPipeStrategy

warnings.filterwarnings("ignore")


class NoJoinStrategy(RoundPipeStrategy):
    """The strategy without the join after the step (what it did before issue 20)."""

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        return ParallelStrategy.optimizer_step(self, optimizer, closure, model, **kwargs)


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4, foreach=True)


class StepTimer(L.Callback):
    def __init__(self):
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        self.starts.append(time.perf_counter())

    def steady(self) -> list[float]:
        times = [b - a for a, b in zip(self.starts, self.starts[1:])]
        return times[2:]


def one_fit(strategy_cls, width, depth, batch, steps, clip) -> list[float]:
    timer = StepTimer()
    data = TensorDataset(torch.randn(batch * (steps + 2), width))
    trainer = L.Trainer(strategy=strategy_cls(microbatches=2, partition="params"), accelerator="cpu", devices=2,
                        max_steps=steps + 2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer], gradient_clip_val=1.0 if clip else None)
    trainer.fit(TanhMLP(width, depth, ADAMW), DataLoader(data, batch_size=batch))
    return timer.steady()


def main(argv=None) -> dict:
    p = cli(__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batches", default="16,256", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=8, help="timed steps per fit")
    p.add_argument("--rounds", type=int, default=3, help="alternating fits per variant")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for clip in (False, True):
            times = {"join": [], "no join": []}
            for _ in range(args.rounds):
                times["join"] += one_fit(RoundPipeStrategy, args.width, args.depth, batch, args.steps, clip)
                times["no join"] += one_fit(NoJoinStrategy, args.width, args.depth, batch, args.steps, clip)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"batch": batch, "early_steps": not clip, "join_s": med["join"], "no_join_s": med["no join"],
                         "ratio": med["join"] / med["no join"], "samples": len(times["join"])})
    params = args.depth * (args.width * args.width + args.width)
    print(f"MLP {args.depth} x Linear({args.width}) ({params / 1e6:.1f}M parameters), AdamW, 2 CPU workers, "
          f"microbatches=2; median step time of {args.rounds} alternating fits x {args.steps} steps each")
    print("| batch | layer steps during backward | join (s) | no join (s) | join / no join |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {'yes' if r['early_steps'] else 'no (clipping)'} | {r['join_s']:.4f} | "
              f"{r['no_join_s']:.4f} | {r['ratio']:.3f} |")
    out = {"width": args.width, "depth": args.depth, "rows": rows}
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
