"""What keeping a failed step undoable costs: step time and peak host memory, undo on against undo off.

Trains a ~100M-parameter MLP with AdamW through the overlapped optimizer (layers step during the
closure's last backward) on the CPU backend, with ``undo=True`` and ``undo=False``, each in its
own process so peak RSS is its own, interleaved ``--repeats`` times; ``--baseline REV`` adds the
code of a git revision (its default undo setting) as a third system. Measured, not simulated.

``--paired``: on a shared, noisy machine separate processes see different load, so the step
time is instead compared within one process per code version, undo switched on and off on
alternate steps (``OverlappedOptimizer.keep_undo``, read at each step): the figure is the median
over adjacent on/off pairs of on / off, after ``PAIRED_WARMUP`` steps that allocate the state
and the undo buffers.

``--paired --journal-layers K``: three systems in one process, on steps taken in turn: undo off, the
full undo (``journal_bytes=None``: a before-image of every layer, the undo before the journal) and
a journal holding K layers' before-images (the rest wait until the step is known good), each with
its own reused buffers; the figures are medians over adjacent triples of full / off and journal / off.

    python benchmarks/figures/step_undo_cost.py [--steps 6] [--repeats 2] [--baseline REV] [--paired]
        [--journal-layers K]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.harness import cli, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

CHILD = r"""
import json, resource, sys, time
import torch
from torch import nn
from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

width, depth, steps, undo, workers = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
journal_layers = int(sys.argv[6]) if len(sys.argv) > 6 else 0
paired = undo == "paired"
undo = "on" if paired else undo
torch.manual_seed(0)
net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
params = sum(p.numel() for p in net.parameters())
opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
runtime = RoundPipeRuntime.attach(net, "cpu", workers, RuntimeOptions(microbatches=2, step_metrics=False))
try:
    ov = runtime.overlap_optimizer(opt, undo=undo == "on")
except TypeError:  # a revision from before the undo option: undo always on
    if undo != "on":
        raise SystemExit("this revision has no undo option")
    ov = runtime.overlap_optimizer(opt)
last = getattr(ov, "last_backward", None)
if journal_layers:  # off, full undo, journal of K layers in turn, each with its own buffers
    from lightning_roundpipe.optim.step_undo import BeforeImages
    layer_image = (width * width + width) * 4 * 3 + 4 * 64  # weight, bias, 2 moments each, 2 step counts (aligned)
    modes = [(False, None, BeforeImages()), (True, None, BeforeImages()), (True, journal_layers * layer_image, BeforeImages())]
x, y = torch.randn(8, width), torch.randn(8, width)
times = []
for i in range(steps):
    if journal_layers:
        ov.keep_undo, ov.journal_bytes, ov.before_images = modes[i % 3]
    elif paired:
        ov.keep_undo = i % 2 == 0  # on, off, on, off, ...
    def closure():
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        if last is None:
            loss.backward()
        else:
            with last():
                loss.backward()
        return loss
    t0 = time.perf_counter()
    opt.step(closure)
    runtime.join()
    times.append(time.perf_counter() - t0)
runtime.detach()
print(json.dumps({"params": params, "step_s": times, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run(src: str, undo: str, width: int, depth: int, steps: int, workers: int = 2, journal_layers: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, "-c", CHILD, str(width), str(depth), str(steps), undo, str(workers),
                          str(journal_layers)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        if "no undo option" in out.stderr:
            return None
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


PAIRED_WARMUP = 4  # steps 0-3 allocate optimizer state and undo buffers


def _sources(tmp: str, baseline: str | None) -> dict[str, str]:
    """``src`` of this tree, and of ``baseline`` (a git revision) extracted under ``tmp``."""
    sources = {"this tree": os.path.join(ROOT, "src")}
    if baseline:
        archive = subprocess.run(["git", "-C", ROOT, "archive", baseline, "src"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        sources[f"baseline {baseline}"] = os.path.join(tmp, "src")
    return sources


def triples(args) -> None:
    """Undo off, full undo and a K-layer journal within one process (see the module doc)."""
    warmup = 6  # two rounds of the three: state and every system's buffers allocated
    steps = warmup + 3 * max(2, (args.steps + 2) // 3)
    full, journal = [], []
    for _ in range(args.repeats):
        t = run(os.path.join(ROOT, "src"), "paired", args.width, args.depth, steps, args.workers,
                args.journal_layers)["step_s"]
        full += [t[i + 1] / t[i] for i in range(warmup, steps, 3)]
        journal += [t[i + 2] / t[i] for i in range(warmup, steps, 3)]
    summary = {"full undo / off step time, median": statistics.median(full),
               f"journal of {args.journal_layers} of {args.depth} layers / off step time, median": statistics.median(journal),
               "journal / full undo, median": statistics.median([j / f for j, f in zip(journal, full)]),
               "triples": len(full), "full/off all": full, "journal/off all": journal}
    print(json.dumps(summary, indent=2))
    if args.json:
        write_json(args.json, summary)


def paired(args) -> None:
    """Undo on / off step time within one process per code version (see the module doc)."""
    steps = max(args.steps, PAIRED_WARMUP + 4)
    steps += steps % 2
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sources = _sources(tmp, args.baseline)
        for _ in range(args.repeats):
            for name, path in sources.items():
                t = run(path, "paired", args.width, args.depth, steps, args.workers)["step_s"]
                ratios.setdefault(name, []).extend(t[i] / t[i + 1] for i in range(PAIRED_WARMUP, steps, 2))
    summary = {name: {"undo on / off step time, median of pairs": statistics.median(r), "pairs": len(r),
                      "min": min(r), "max": max(r)} for name, r in ratios.items()}
    print(json.dumps(summary, indent=2))
    if args.json:
        write_json(args.json, summary)


def main(argv=None) -> None:
    ap = cli(__doc__.splitlines()[0], json_help="also write the summary to this JSON file")
    ap.add_argument("--baseline", default=None, help="also run the code of this git revision (its default undo)")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=24, help="layers of width x width (24 x 2048^2: 100.7M parameters)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2, help="CPU workers (--paired only; 1 leaves the lane a core on 2)")
    ap.add_argument("--paired", action="store_true", help="undo on and off on alternate steps of one process")
    ap.add_argument("--journal-layers", type=int, default=0,
                    help="--paired: also a journal of this many layers' before-images (off / full / journal in turn)")
    args = ap.parse_args(argv)
    if args.paired and args.journal_layers:
        return triples(args)
    if args.paired:
        return paired(args)
    src = os.path.join(ROOT, "src")
    systems = {"undo off": (src, "off"), "undo on": (src, "on")}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            archive = subprocess.run(["git", "-C", ROOT, "archive", args.baseline, "src"], capture_output=True,
                                     check=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
            for undo in ("off", "on"):
                systems[f"baseline {args.baseline} undo {undo}"] = (os.path.join(tmp, "src"), undo)
        results: dict[str, list] = {k: [] for k in systems}
        for _ in range(args.repeats):
            for name, (path, undo) in systems.items():
                r = run(path, undo, args.width, args.depth, args.steps)
                if r is not None:
                    results[name].append(r)
    summary: dict = {}
    for name, rs in results.items():
        if not rs:
            continue
        steady = [t for r in rs for t in r["step_s"][2:]]  # the first two steps allocate state
        summary[name] = {"params": rs[0]["params"], "median_step_s": statistics.median(steady),
                         "peak_rss_gib": max(r["peak_rss_bytes"] for r in rs) / 2**30}
    for prefix in ["", f"baseline {args.baseline} "] if args.baseline else [""]:
        off, on = summary.get(prefix + "undo off"), summary.get(prefix + "undo on")
        if off and on:
            summary[prefix + "undo on / off"] = {"step_time": on["median_step_s"] / off["median_step_s"],
                                                 "extra_peak_rss_gib": on["peak_rss_gib"] - off["peak_rss_gib"]}
    print(json.dumps(summary, indent=2))
    if args.json:
        write_json(args.json, summary)


if __name__ == "__main__":
    main()
