"""Issue-5 figures: the host optimizer hidden behind the pipeline, AdamW kernels, host bytes per parameter.

    python benchmarks/figures/optimizer_overlap.py [--params 100e6] [--steps 4] [--json out.json]

1. A model of ``--params`` parameters (an nn.Sequential of wide Linear+Tanh layers) trained with
   AdamW under ``RoundPipeStrategy`` on 2 CPU workers, overlapped optimizer against the plain
   synchronous step, side by side in one run (alternating). Reported: optimizer time per step
   (the per-layer optimizer tasks on the timeline; for the synchronous step, its wall time), the
   share of it hidden (time of optimizer tasks overlapped by worker compute / total optimizer
   time, from the timeline), step time, and whether the final weights are bit-identical.
2. ``torch.optim.AdamW`` on the same parameter count with ``fused=True``, ``foreach=True`` and the
   single-tensor loop: time per step on this CPU.
3. Host bytes per parameter in each precision mode, counted from the tensors that exist after a
   step (masters, gradients, optimizer state, shadows).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import cli, write_json  # noqa: E402
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.tracing.timeline import hidden_share

warnings.filterwarnings("ignore")


def build(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


class Module(L.LightningModule):
    def __init__(self, width, depth, fused):
        super().__init__()
        self.net = build(width, depth)
        self.fused = fused

    def training_step(self, batch, i):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=self.fused or None, foreach=None if self.fused else True)


class StepTimer(L.Callback):
    def __init__(self):
        self.times, self.opt_times, self._t = [], [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._t)


class SyncOptTimer(L.Callback):
    """Times the synchronous optimizer.step (only used with overlap off)."""

    def on_train_start(self, trainer, pl_module):
        self.times = []
        opt = trainer.optimizers[0]
        original = opt.step

        def timed(*a, **k):
            closure = k.pop("closure", None) or (a[0] if a else None)
            loss = closure() if closure is not None else None
            t0 = time.perf_counter()
            original()
            self.times.append(time.perf_counter() - t0)
            return loss

        opt.step = timed


def run_fit(width, depth, steps, overlap, fused, records_out):
    m = Module(width, depth, fused)
    timer = StepTimer()
    cbs = [timer]
    sync = None
    if not overlap:
        sync = SyncOptTimer()
        cbs.append(sync)

    class Grab(L.Callback):
        def on_train_end(self, trainer, pl_module):
            records_out.extend(trainer.strategy.runtime.trace.records())

    cbs.append(Grab())
    data = DataLoader(TensorDataset(torch.randn(16 * steps, width)), batch_size=16)
    trainer = L.Trainer(strategy=RoundPipeStrategy(microbatches=4, overlap_optimizer=overlap, trace_steps=steps),
                        accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)
    trainer.fit(m, data)
    weights = [p.detach().clone() for p in m.parameters()]
    return timer.times, (sync.times if sync else None), weights


def overlap_figures(params: float, steps: int, width: int = 2048) -> dict:
    depth = max(2, round(params / (width * width + width)))
    n_params = depth * (width * width + width)
    rows = {}
    results = {}
    for overlap in (False, True, False, True):  # alternate: each configuration twice, side by side
        records: list = []
        times, sync_times, weights = run_fit(width, depth, steps, overlap, fused=True, records_out=records)
        key = "overlapped" if overlap else "synchronous"
        results.setdefault(key, []).append((times, sync_times, records, weights))
    for key, runs in results.items():
        step_s = statistics.median(t for times, _, _, _ in runs for t in times[1:])
        if key == "synchronous":
            opt_s = statistics.median(t for _, st, _, _ in runs for t in st[1:])
            hidden = 0.0
        else:
            per_run = []
            shares = []
            for _, _, records, _ in runs:
                steps_seen = sorted({r.step for r in records if r.kind == "optim"})[1:]
                for s in steps_seen:
                    per_run.append(sum(r.duration for r in records if r.kind == "optim" and r.step == s))
                later = [r for r in records if r.step != min(r.step for r in records)]
                shares.append(hidden_share(later, kind="optim"))
            opt_s = statistics.median(per_run)
            hidden = statistics.median(shares)
        rows[key] = {"step_s": step_s, "optimizer_s_per_step": opt_s, "hidden_share": hidden}
    ref = results["synchronous"][0][3]
    identical = all(torch.equal(a, b) for runs in results.values() for *_, w in runs for a, b in zip(ref, w))
    return {"params": n_params, "width": width, "depth": depth, "rows": rows, "bit_identical": identical}


def kernel_figures(params: float, repeats: int = 3, side: int = 4096) -> dict:
    n = int(params)
    shapes = [(side, side)] * max(1, n // (side * side))
    out = {}
    for name, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("for-loop", {"foreach": False})):
        ps = [torch.zeros(s, requires_grad=True) for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        opt = torch.optim.AdamW(ps, lr=1e-3, **kw)
        opt.step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        out[name] = {"params": sum(p.numel() for p in ps), "s_per_step": statistics.median(times)}
        del ps, opt
    return out


def bytes_per_param() -> dict:
    """Host bytes per parameter after one AdamW step, for each precision mode (small model)."""
    from lightning_roundpipe.lightning.precision import HostScaledMixedPrecision

    out = {}
    for mode in ("32-true", "bf16-mixed", "16-mixed", "bf16-true"):
        m = Module(256, 4, fused=False)
        kwargs = {"plugins": [HostScaledMixedPrecision(init_scale=2.0**4)]} if mode == "16-mixed" else {"precision": mode}
        counted = {}

        class Count(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                trainer.strategy.join()
                params = list(pl_module.parameters())
                n = sum(p.numel() for p in params)
                masters = sum(p.numel() * p.element_size() for p in params)
                grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
                state = sum(v.numel() * v.element_size() for s in trainer.optimizers[0].state.values()
                            for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
                shadows = trainer.strategy.runtime.shadows.nbytes() if trainer.strategy.runtime.shadows is not None else 0
                counted.update(masters=masters / n, grads=grads / n, optimizer_state=state / n, shadows=shadows / n,
                               total=(masters + grads + state + shadows) / n)

        trainer = L.Trainer(strategy=RoundPipeStrategy(microbatches=2), accelerator="cpu", devices=2, max_steps=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[Count()], **kwargs)
        trainer.fit(m, DataLoader(TensorDataset(torch.randn(16, 256)), batch_size=8))
        out[mode] = counted
    return out


def main(argv=None):
    ap = cli(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--width", type=int, default=2048, help="of the Linear layers; AdamW's kernels run on tensors "
                    "twice as wide (the smoke test: 64)")
    args = ap.parse_args(argv)
    print(f"# python benchmarks/figures/optimizer_overlap.py --params {args.params:g} --steps {args.steps} "
          f"--width {args.width}")
    ov = overlap_figures(args.params, args.steps, args.width)
    print(f"\n## Overlapped host optimizer ({ov['params'] / 1e6:.1f}M parameters, AdamW fused, 2 CPU workers)\n")
    print("| optimizer | step s | optimizer s/step | hidden share |")
    print("|---|---:|---:|---:|")
    for k, r in ov["rows"].items():
        print(f"| {k} | {r['step_s']:.3f} | {r['optimizer_s_per_step']:.3f} | {100 * r['hidden_share']:.0f}% |")
    print(f"\nfinal weights bit-identical across all runs: {ov['bit_identical']}")
    kern = kernel_figures(args.params, side=2 * args.width)
    print(f"\n## torch AdamW kernels on this CPU ({next(iter(kern.values()))['params'] / 1e6:.0f}M parameters)\n")
    print("| implementation | s/step |")
    print("|---|---:|")
    for k, r in kern.items():
        print(f"| {k} | {r['s_per_step']:.3f} |")
    bpp = bytes_per_param()
    print("\n## Host bytes per parameter (after one AdamW step)\n")
    print("| precision | masters | grads | optimizer state | shadows | total |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, r in bpp.items():
        print(f"| {k} | {r['masters']:.0f} | {r['grads']:.0f} | {r['optimizer_state']:.0f} | {r['shadows']:.0f} | {r['total']:.0f} |")
    if args.json:
        write_json(args.json, {"overlap": ov | {"rows": ov["rows"]}, "kernels": kern, "bytes_per_param": bpp})


if __name__ == "__main__":
    main()
