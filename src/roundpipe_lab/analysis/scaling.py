"""Predicted throughput against the number of GPUs: the reference workload on 1..N workers.

For each model, the published run's RoundPipe workload (same sequences per optimizer step,
microbatches and calls, one-step-stale optimizer) is simulated on the profile with
``num_gpus`` replaced. The plan is the reference's own partition for the models it published
one for (``reference_plan``; RoundPipe's stages are not
bound to GPUs, so one partition serves every count) and the planner's best plan for the count
otherwise, or always with ``planner=True``. Speedup is over the smallest count and efficiency
is speedup over the count ratio. Every number is simulated; ``MEASURED_SCALING`` holds the
reference's measured curve on 1-8 RTX 4090 for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_roundpipe.cost.hardware import HardwareProfile, load_hardware
from lightning_roundpipe.cost.text_table import render_table
from .workload import PUBLISHED_RUNS, REFERENCE_PARTITIONS, Workload, reference_plan, simulate_workload

MEASURED_HARDWARE = "rtx4090"  # the profile the measured curve belongs to
# Measured tokens/s of the reference on 1..8 RTX 4090 (same workloads as the 8-GPU table; the
# artifact's exp/raw-data.csv, "4090s" rows).
MEASURED_SCALING = {
    "qwen3-1.7b": (8880.99, 17025.55, 25702.44, 33178.39, 42026.2, 48829.86, 57598.61, 65416.83),
    "llama-3.1-8b": (3142.17, 6259.09, 9221.6, 12277.77, 15342.93, 18363.22, 21296.67, 24274.54),
    "qwen3-32b": (740.46, 1476.11, 2203.82, 2897.08, 3599.81, 4290.25, 4913.34, 5516.22),
}


@dataclass
class ScalingRow:
    """Simulated throughput of one model on a number of GPUs."""
    model: str
    num_gpus: int
    tokens_per_s: float
    speedup: float  # over the smallest count simulated
    bubble: float
    measured: float | None = None  # the reference's measured tokens/s at this count, when published


def reference_workload(model: str) -> Workload:
    """The published RoundPipe workload of ``model``, or Qwen3-1.7B's for a model not in the table."""
    for run in PUBLISHED_RUNS:
        if run.model == model:
            return run.stale
    return PUBLISHED_RUNS[0].stale


def scaling_rows(models: tuple[str, ...], hardware: str | HardwareProfile, gpu_counts: tuple[int, ...],
                 workload: Workload | None = None, planner: bool = False) -> list[ScalingRow]:
    """Simulated tokens/s of each model at each GPU count (see the module doc)."""
    if not gpu_counts or min(gpu_counts) < 1:
        raise ValueError(f"GPU counts must be positive, got {gpu_counts}")
    hw = load_hardware(hardware)
    rows = []
    for model in models:
        w = workload or reference_workload(model)
        base = None
        plan = reference_plan(model) if model in REFERENCE_PARTITIONS and not planner else None
        same_machine = workload is None and hw.name == MEASURED_HARDWARE
        measured = MEASURED_SCALING.get(model, ()) if same_machine else ()
        for n in sorted(gpu_counts):
            r = simulate_workload(model, hw.replace(num_gpus=n), w, plan=plan)
            base = base or r.tokens_per_s
            rows.append(ScalingRow(model, n, r.tokens_per_s, r.tokens_per_s / base, r.call.bubble_fraction,
                                   measured[n - 1] if n <= len(measured) else None))
    return rows


def scaling_markdown(rows: list[ScalingRow], hardware: str | HardwareProfile) -> str:
    """The scaling rows as a markdown table, one row per model and GPU count."""
    hw = load_hardware(hardware)
    header = ("model", "GPUs", "tokens/s (simulated)", "speedup", "efficiency", "bubble", "measured (reference)", "error")
    cells = []
    first = {}
    for r in rows:
        first.setdefault(r.model, r.num_gpus)
        eff = r.speedup * first[r.model] / r.num_gpus
        measured = (f"{r.measured:,.0f}", f"{r.tokens_per_s / r.measured - 1:+.1%}") if r.measured else ("-", "-")
        cells.append((r.model, str(r.num_gpus), f"{r.tokens_per_s:,.0f}", f"{r.speedup:.2f}x", f"{eff:.0%}",
                      f"{r.bubble:.0%}", *measured))
    lines = [f"Simulated tokens/s on 1..N x {hw.name} (reference workload, one-step-stale optimizer)", "",
             render_table(header, cells, right=range(1, 8), markdown=True)]
    return "\n".join(lines)
