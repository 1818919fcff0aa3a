"""The GPU machine's validation run, one command inside a time budget (docs/gpu_validation.md):

    python -m benchmarks.validation.gpu_session --budget 480 --out DIR          # on the GPU machine
    python -m benchmarks.validation.gpu_session --device fake_cuda --quick --out DIR   # here and in CI

Each part runs in a subprocess of its own with its own deadline (its limit, cut to the budget left); the
JSON is rewritten after each part, so a run cut short keeps what it measured. A part that overruns is
killed and fails; a part the budget no longer reaches is skipped. It writes at most four files in DIR:
``gpu_session.json`` (a verdict per part: pass, fail or skip, with figures), ``gpu_session.log`` (every
part's output), ``trace.json`` (the Chrome trace of one pipelined step) and ``memory.txt``. Needs only torch,
Lightning, transformers and peft (no Hydra, OmegaConf or datasets, no network); layers run eagerly except in
the last part, ``compiled_layers``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a file: the repository root holds benchmarks/
    sys.path.insert(0, str(REPO))

from benchmarks.harness import write_json  # noqa: E402

RESULT_MARK = "GPU_SESSION_RESULT "
VERDICTS = ("pass", "fail", "skip")
MIN_PART_S = 20.0  # a part given less than this is skipped: it could not even import torch and build a model


@dataclass(frozen=True)
class Part:
    """One part: what it checks, its time limit on a GPU and in a quick fake-driver run, in seconds."""

    what: str
    limit_s: float
    quick_limit_s: float
    fake_skip: str | None = None  # why the part means nothing on the fake driver (skipped there, not spawned)


PARTS = {
    "environment": Part("GPU, driver, versions, PCIe, cores, memlock limit", 40, 30),
    "lightning_parity": Part("the Lightning strategy against Lightning's default strategy on the same device", 120, 90),
    "gpu_tests": Part("pytest -m gpu (the GPU-only tests)", 90, 30,
                      fake_skip="needs a GPU: the tests marked gpu run CUDA kernels, which the fake driver cannot"),
    "plain_vs_pipeline": Part("throughput and memory against plain single-GPU training (Qwen3-0.6B shape)", 120, 60),
    "device_syncs": Part("device syncs per step after warming every mask variant", 60, 45),
    "failures": Part("task exception, OOM, hang, device-side assert: reported in time, naming the task", 60, 40),
    "compiled_layers": Part("compiled layers: compile seconds, recompiles, loss against eager", 180, 60),
}


def run_part(name: str, device: str, quick: bool, out_dir: Path) -> tuple[str, str, dict]:
    """The part's own work, in this (child) process: ``(verdict, summary, details)``."""
    from benchmarks.validation.gpu_checks.context import Ctx

    ctx = Ctx("cuda" if device == "cuda" else "fake_cuda", quick, None, compile_layers=name == "compiled_layers")
    if name == "environment":
        from benchmarks.validation.gpu_checks.session_environment import check_session_environment

        return check_session_environment(ctx)
    if name == "lightning_parity":
        from benchmarks.validation.gpu_checks.lightning_parity import check_lightning_parity

        return check_lightning_parity(ctx)
    if name == "gpu_tests":
        return run_gpu_tests(ctx, out_dir)
    if name == "plain_vs_pipeline":
        from benchmarks.validation.gpu_checks.plain_vs_pipeline import check_plain_vs_pipeline

        return check_plain_vs_pipeline(ctx, out_dir)
    if name == "device_syncs":
        from benchmarks.validation.gpu_checks.syncs import check_device_syncs

        return check_device_syncs(ctx)
    if name == "failures":
        from benchmarks.validation.gpu_checks.failures import check_failures

        ctx.device_assert = True  # last case: on a GPU it breaks this process's CUDA context
        return check_failures(ctx)
    from benchmarks.validation.gpu_checks.compiled import check_compiled_layers

    return check_compiled_layers(ctx)


def run_gpu_tests(ctx, out_dir: Path) -> tuple[str, str, dict]:
    """``pytest -m gpu`` over the test files that hold GPU tests (the others may need the job's dependencies)."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return "skip", "pytest is not installed in this image", {}
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text())
    if not files:
        return "fail", "no test file marks a test gpu", {}
    # no:hydra_pytest: where Hydra is installed but unusable, its pytest plugin would fail the collection
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hydra_pytest",
                          "-m", "gpu", *files],
                         cwd=REPO, capture_output=True, text=True)
    tail = (run.stdout + run.stderr).strip().splitlines()[-30:]
    verdict = "pass" if run.returncode == 0 else "fail"
    return verdict, (tail[-1] if tail else f"pytest exited {run.returncode}"), dict(
        files=files, returncode=run.returncode, tail=tail)


def child(args) -> int:
    """``--part NAME``: run one part and print its result as the last line."""
    t0 = time.perf_counter()
    try:
        verdict, summary, details = run_part(args.part, args.device, args.quick, Path(args.out))
    except Exception as err:  # noqa: BLE001 - a part that crashes is a failed part
        verdict, summary, details = "fail", f"{type(err).__name__}: {err}"[:300], dict(traceback=traceback.format_exc())
    result = dict(verdict=verdict, summary=summary, seconds=time.perf_counter() - t0, details=details)
    print(RESULT_MARK + json.dumps(result, default=str), flush=True)
    return 0


def part_result(proc_out: str, rc: int | None, timed_out: bool, deadline_s: float, seconds: float) -> dict:
    """The report entry of a part from its child's output."""
    if timed_out:
        return dict(verdict="fail", summary=f"timed out: killed after its deadline of {deadline_s:g}s",
                    seconds=seconds, details={})
    for line in reversed(proc_out.splitlines()):
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK):])
            result["seconds"] = seconds
            return result
    tail = proc_out.strip().splitlines()[-5:]
    return dict(verdict="fail", summary=f"the part's process exited {rc} without a result: " + " | ".join(tail)[-300:],
                seconds=seconds, details=dict(tail=tail))


def spawn(name: str, args, deadline_s: float, log) -> dict:
    """Run part ``name`` in a subprocess (its own process group) for at most ``deadline_s``."""
    cmd = [sys.executable, "-m", "benchmarks.validation.gpu_session", "--part", name, "--device", args.device,
           "--out", str(args.out)] + (["--quick"] if args.quick else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), str(REPO / "src")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the part and anything it started
        out, _ = proc.communicate()
    seconds = time.monotonic() - t0
    log.write(f"\n===== {name} ({seconds:.1f}s, deadline {deadline_s:.0f}s) =====\n{out}")
    log.flush()
    return part_result(out, proc.returncode, timed_out, deadline_s, seconds)


def parent(args) -> int:
    """Every part in order within the budget; the JSON after each. Exit status 0 unless a part failed."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = dict(device=args.device, quick=args.quick,
                  budget_s=args.budget, started=time.strftime("%Y-%m-%dT%H:%M:%S"), parts={}, verdict="incomplete")
    json_path = out / "gpu_session.json"
    with open(out / "gpu_session.log", "w") as log:
        for name in args.parts:
            part = PARTS[name]
            left = args.budget - (time.monotonic() - started)
            deadline = min(part.quick_limit_s if args.quick else part.limit_s, left)
            if args.device == "fake_cuda" and part.fake_skip:
                entry = dict(verdict="skip", summary=part.fake_skip, seconds=0.0, details={})
            elif deadline < MIN_PART_S:
                entry = dict(verdict="skip", summary=f"no budget left ({left:.0f}s of {args.budget:.0f}s)",
                             seconds=0.0, details={})
            else:
                entry = spawn(name, args, deadline, log)
            entry["what"] = part.what
            report["parts"][name] = entry
            report["seconds"] = time.monotonic() - started
            write_json(json_path, report)
            print(f"{entry['verdict'].upper():4s} {name:18s} {entry['seconds']:6.1f}s  {entry['summary']}", flush=True)
    verdicts = [p["verdict"] for p in report["parts"].values()]
    report["verdict"] = "fail" if "fail" in verdicts else "pass"
    report["seconds"] = time.monotonic() - started
    write_json(json_path, report)
    print(f"overall: {report['verdict'].upper()} in {report['seconds']:.0f}s ({json_path})", flush=True)
    return 1 if report["verdict"] == "fail" else 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the JSON, the log, the trace and the memory summary")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all parts (default 480: a 600 s "
                                                                 "command limit keeps room for start-up)")
    ap.add_argument("--device", choices=("cuda", "fake_cuda"), default="cuda",
                    help="cuda: the GPU; fake_cuda: the fake CUDA driver on CPU threads (CI)")
    ap.add_argument("--quick", action="store_true", help="smaller shapes and fewer steps (CI)")
    ap.add_argument("--parts", nargs="+", choices=tuple(PARTS), default=list(PARTS), help="run only these parts")
    ap.add_argument("--part", choices=tuple(PARTS), help=argparse.SUPPRESS)  # the child's one part
    args = ap.parse_args(argv)
    if args.budget <= 0:
        ap.error(f"--budget must be positive, got {args.budget}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return child(args) if args.part else parent(args)


if __name__ == "__main__":
    sys.exit(main())
