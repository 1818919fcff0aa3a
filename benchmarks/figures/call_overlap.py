"""The next accumulation call's forward overlapping the previous call's backward drain (``overlap_calls``).

    python -m benchmarks.figures.call_overlap [--quick] [--accumulate 4] [--steps 22] [--json out.json]

An nn.Sequential of Linear+Tanh blocks under ``RoundPipeStrategy`` on 2 CPU workers with
``accumulate_grad_batches`` calls per optimizer step. Side by side in one fit: the optimizer
steps alternate between overlapped calls and waiting ones (the strategy's ``calls_overlap``
switched at the first batch of each step), so both see the same load. Reported: the median
step time of each (from the end of one step to the end of the next; the first two steps left
out), their ratio (waiting / overlapped: above 1 is a gain), and whether two short fits, one
with ``overlap_calls=True`` and one with False, end with bit-identical weights. Timings on a
shared host are noisy: read the ratio, with the load average printed beside it.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.figures.tanh_mlp import TanhMLP  # noqa: E402
from benchmarks.harness import cli, markdown_table, write_json  # noqa: E402
from lightning_roundpipe import RoundPipeStrategy  # noqa: E402

warnings.filterwarnings("ignore")


SGD = functools.partial(torch.optim.SGD, lr=1e-3)


class AlternateSteps(L.Callback):
    """Even optimizer steps overlap their calls, odd ones wait; keeps each step's duration by mode."""

    def __init__(self):
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.last_end: float | None = None
        self.mode = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.mode = (batch_idx // trainer.accumulate_grad_batches) % 2 == 0
            trainer.strategy.calls_overlap = self.mode

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        now = time.perf_counter()
        if self.last_end is not None and batch_idx // trainer.accumulate_grad_batches >= 2:
            self.times[self.mode].append(now - self.last_end)
        self.last_end = now


def fit(width: int, depth: int, batch: int, accumulate: int, steps: int, microbatches: int, overlap_calls=True,
        callbacks=()):
    module = TanhMLP(width, depth, SGD)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(batch * accumulate * steps, width, generator=g))
    trainer = L.Trainer(strategy=RoundPipeStrategy(microbatches=microbatches, overlap_calls=overlap_calls),
                        accelerator="cpu", devices=2, max_steps=steps, accumulate_grad_batches=accumulate,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(module, DataLoader(data, batch_size=batch))
    return [p.detach().clone() for p in module.parameters()]


def main(argv=None) -> int:
    parser = cli(__doc__.splitlines()[0], quick="a smaller model, 8 steps")
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--steps", type=int, default=22, help="optimizer steps of the alternating fit")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.steps = 384, 8
    shape = (args.width, args.depth, args.batch, args.accumulate)
    alternate = AlternateSteps()
    fit(*shape, args.steps, args.microbatches, callbacks=[alternate])
    times = alternate.times
    identical = all(torch.equal(a, b) for a, b in zip(fit(*shape, 3, args.microbatches, overlap_calls=True),
                                                     fit(*shape, 3, args.microbatches, overlap_calls=False)))
    overlapped, waiting = statistics.median(times[True]), statistics.median(times[False])
    load = os.getloadavg()
    rows = [{"setup": "waiting (overlap_calls=False)", "ms": waiting * 1e3},
            {"setup": "overlapped (overlap_calls=True)", "ms": overlapped * 1e3}]
    print(markdown_table(rows, [("setup", "setup", "{}"), ("ms", "median step ms", "{:.1f}")]))
    print(f"waiting / overlapped = {waiting / overlapped:.3f}  (accumulate_grad_batches={args.accumulate}, "
          f"{args.microbatches} microbatches, width {args.width}, depth {args.depth}, batch {args.batch}; "
          f"{len(times[True])} steps each); weights bit-identical: {identical}; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        write_json(args.json, {"accumulate": args.accumulate, "waiting_step_s": waiting, "overlapped_step_s": overlapped,
                               "ratio": waiting / overlapped, "bit_identical": identical, "load_average": list(load),
                               "steps_each": len(times[True]), "overlapped_steps_s": times[True],
                               "waiting_steps_s": times[False]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
