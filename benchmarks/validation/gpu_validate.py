"""The first GPU run in one command: a verdict per check and one JSON file, in under 10 minutes on 1 or 8 GPUs.

    python -m benchmarks.validation.gpu_validate --json gpu_validate.json      # every visible GPU
    python -m benchmarks.validation.gpu_validate --gpus 1 --quick              # one GPU, smaller shapes
    python -m benchmarks.validation.gpu_validate --device cpu --quick          # the CPU self-test (fake streams)
    python -m benchmarks.validation.gpu_validate --dry-run                     # the checks and the JSON's form

Checks, in order (each prints PASS / FAIL / SKIP and a one-line summary; details go to the JSON,
written after every check so a run cut short keeps what it measured):

- ``environment``: GPUs (name, memory, capability), PCIe generation and width (current and
  maximum) and NUMA node per GPU, cores (all and usable), torch's intra- and inter-op threads.
- ``parity_fp32``: an fp32 MLP trained 3 SGD steps on 1 and on N GPUs against the CPU backend
  with as many workers: first-step gradients within 1e-5, weights within 1e-4 of the update.
- ``parity_bf16_qwen3``: a tiny Qwen3 (from a config), bf16 compute, 5 AdamW steps overlapped with
  the pipeline, against the plain model under autocast on one device: losses and weights within bf16 rounding.
- ``dropout_recompute``: dropout masks drawn in recompute equal the forward's, on distinct GPUs and
  with three workers sharing GPU 0 (gradients equal a replay of the per-layer seeds on the plain layers).
- ``jitter_bit_identical``: random stream delays (the race amplifier) leave the weights after 3
  overlapped steps bit-identical to the calm run, exact and ``staleness=1``, distinct and shared GPUs.
- ``device_syncs``: device syncs per step made in the workers' threads, counted through
  ``torch.cuda.set_sync_debug_mode("warn")`` after a warm-up step: must be 0.
- ``throughput``: a Qwen3-1.7B shape and a Llama-3.1-8B-width slice, bf16, overlapped AdamW, at 1
  and N GPUs: tokens/s beside the simulator's prediction for the same plan and workload (at the
  GPU's hardware profile, with compiled layers when the run compiles them, as the CUDA backend
  does by default); achieved / simulated >= 0.9; the warm-up step's seconds and the compile
  seconds in it are reported.
- ``bandwidth``: bare pinned H2D and D2H per GPU, alone and all GPUs at once, beside the
  pipeline's achieved upload bandwidth and exposed transfer time (from the throughput runs).
- ``memory``: per GPU the allocated and reserved peaks against the plan's bound, allocator retries
  after warm-up (0), pinned bytes, RSS (from the throughput runs).
- ``failures``: a task exception, an out-of-memory and a hang each reported within its timeout
  (+1 s) naming the task, no thread of ours left, and the next step exact.

``--device cpu`` runs every check that needs no GPU on the fake-stream backend (the CUDA protocol
on CPU threads, tiny shapes), and skips the others: the CPU self-test. ``--dry-run`` runs nothing
and writes the report's form with every check skipped.
"""

from __future__ import annotations

import random
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import cli, write_json
from benchmarks.validation.gpu_checks.context import VERDICTS, Ctx
from benchmarks.validation.gpu_checks.environment import check_environment
from benchmarks.validation.gpu_checks.failures import check_failures
from benchmarks.validation.gpu_checks.parity import (check_dropout_recompute, check_jitter_bit_identical,
                                                     check_parity_bf16_qwen3, check_parity_fp32)
from benchmarks.validation.gpu_checks.performance import (check_bandwidth, check_memory, check_throughput,
                                                          predicted_tokens_per_s, shapes)
from benchmarks.validation.gpu_checks.syncs import check_device_syncs

__all__ = ["CHECKS", "Check", "Ctx", "REGISTRY", "main", "parse_args", "predicted_tokens_per_s", "shapes",
           "validate_report"]


# ---------------------------------------------------------------------------- registry and report


@dataclass(frozen=True)
class Check:
    """One check: its function, whether only a GPU can run it, and what it proves (the help line)."""

    run: Callable[[Ctx], tuple[str, str, dict]]
    gpu_only: bool
    what: str


REGISTRY: dict[str, Check] = {
    "environment": Check(check_environment, False, "GPUs, PCIe gen/width, NUMA node per GPU, cores, threads"),
    "parity_fp32": Check(check_parity_fp32, False, "fp32 against the CPU backend on 1 and N GPUs"),
    "parity_bf16_qwen3": Check(check_parity_bf16_qwen3, False, "tiny Qwen3 bf16, 5 overlapped AdamW steps"),
    "dropout_recompute": Check(check_dropout_recompute, False, "recompute's dropout masks equal the forward's"),
    "jitter_bit_identical": Check(check_jitter_bit_identical, False, "jittered runs bit-identical to calm ones"),
    "device_syncs": Check(check_device_syncs, True, "device syncs per step in worker threads: 0"),
    "throughput": Check(check_throughput, False, "1.7B shape and 8B-width slice at 1 and N GPUs vs the simulator"),
    "bandwidth": Check(check_bandwidth, True, "bare pinned H2D/D2H per GPU, alone and at once, vs the pipeline's"),
    "memory": Check(check_memory, True, "allocated/reserved vs the plan's bound, retries 0, pinned, RSS"),
    "failures": Check(check_failures, False, "exception, OOM, hang: reported in time, no thread left, next step exact"),
}
CHECKS = tuple(REGISTRY)
REPORT_KEYS = ("producer", "started", "device", "gpus", "quick", "checks", "verdict", "seconds")
CHECK_KEYS = ("verdict", "summary", "seconds", "details")


def validate_report(report: dict) -> list[str]:
    """What is wrong with a report's form ([] when nothing): the keys, a verdict per check, the overall verdict."""
    problems = [f"missing key {k!r}" for k in REPORT_KEYS if k not in report]
    for name, check in report.get("checks", {}).items():
        if name not in REGISTRY:
            problems.append(f"unknown check {name!r}")
        problems += [f"check {name!r} misses {k!r}" for k in CHECK_KEYS if k not in check]
        if check.get("verdict") not in VERDICTS:
            problems.append(f"check {name!r} has verdict {check.get('verdict')!r}")
    if report.get("verdict") not in ("pass", "fail"):
        problems.append(f"overall verdict {report.get('verdict')!r}")
    return problems


def parse_args(argv=None):
    """The command line (see the module doc)."""
    ap = cli(__doc__.split("\n")[0], quick="smaller shapes and fewer steps",
             json_help="the report (written after every check)", json_default="gpu_validate.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: the GPUs; cpu: the CPU self-test on fake streams (GPU-only checks skipped)")
    ap.add_argument("--gpus", type=int, default=None, help="how many GPUs to use (default: every visible one)")
    ap.add_argument("--only", nargs="*", choices=CHECKS, default=None, help="run only these checks")
    ap.add_argument("--skip", nargs="*", choices=CHECKS, default=(), help="skip these checks")
    ap.add_argument("--dry-run", action="store_true", help="run nothing: write the report's form, every check skipped")
    args = ap.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        ap.error(f"--gpus must be at least 1, got {args.gpus}")
    return args


def run_check(ctx: Ctx, name: str, dry_run: bool) -> dict:
    """One check's entry of the report; a crash is a failed check, never the end of the run."""
    check = REGISTRY[name]
    t0 = time.perf_counter()
    if dry_run:
        verdict, summary, details = "skip", f"dry run: {check.what}", {}
    elif check.gpu_only and not ctx.cuda:
        verdict, summary, details = "skip", "needs a GPU (CPU self-test)", {}
    elif ctx.cuda and ctx.gpus < 1 and name != "environment":
        verdict, summary, details = "skip", "no CUDA device", {}
    else:
        try:
            verdict, summary, details = check.run(ctx)
        except Exception as err:  # noqa: BLE001 - a check that crashes is a failed check, the others still run
            verdict, summary, details = "fail", f"{type(err).__name__}: {err}"[:300], dict(
                traceback=traceback.format_exc())
    if name == "environment":
        ctx.cache["environment"] = details
    return dict(verdict=verdict, summary=summary, seconds=time.perf_counter() - t0, details=details)


def main(argv=None) -> dict:
    """Run the checks asked for; print a line per check; return (and write) the report."""
    args = parse_args(argv)
    started = time.perf_counter()
    ctx = Ctx(args.device, args.quick, args.gpus)
    report = dict(started=time.strftime("%Y-%m-%dT%H:%M:%S"), device=args.device, gpus=ctx.gpus, quick=args.quick,
                  dry_run=args.dry_run, checks={})
    random.seed(0)
    for name in args.only or CHECKS:
        if name in args.skip:
            continue
        entry = run_check(ctx, name, args.dry_run)
        report["checks"][name] = entry
        print(f"{entry['verdict'].upper():4s} {name:22s} {entry['seconds']:6.1f}s  {entry['summary']}", flush=True)
        write_json(args.json, dict(report, verdict="incomplete", seconds=time.perf_counter() - started))
    verdicts = [c["verdict"] for c in report["checks"].values()]
    report["verdict"] = "fail" if "fail" in verdicts else "pass"
    report["seconds"] = time.perf_counter() - started
    write_json(args.json, report)
    report["producer"] = "benchmarks.validation.gpu_validate"
    print(f"overall: {report['verdict'].upper()} in {report['seconds']:.0f}s  ({args.json})")
    return report


if __name__ == "__main__":
    main()
