"""Predicted throughput against the number of GPUs: the reference workload on 1..N workers.

For each model, the published run's RoundPipe workload (same sequences per optimizer step,
microbatches and calls, one-step-stale optimizer) is simulated on the profile with
``num_gpus`` replaced, each count with the planner's best plan for it. Speedup is over one GPU
and efficiency is speedup over the count. Every number is simulated.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import HardwareProfile, load_hardware
from .workload import PUBLISHED_RUNS, Workload, simulate_workload


@dataclass
class ScalingRow:
    model: str
    num_gpus: int
    tokens_per_s: float
    speedup: float  # over the smallest count simulated
    bubble: float


def reference_workload(model: str) -> Workload:
    """The published RoundPipe workload of ``model``, or Qwen3-1.7B's for a model not in the table."""
    for run in PUBLISHED_RUNS:
        if run.model == model:
            return run.stale
    return PUBLISHED_RUNS[0].stale


def scaling_rows(models: tuple[str, ...], hardware: str | HardwareProfile, gpu_counts: tuple[int, ...],
                 workload: Workload | None = None) -> list[ScalingRow]:
    """Simulated tokens/s of each model at each GPU count (see the module doc)."""
    if not gpu_counts or min(gpu_counts) < 1:
        raise ValueError(f"GPU counts must be positive, got {gpu_counts}")
    hw = load_hardware(hardware)
    rows = []
    for model in models:
        w = workload or reference_workload(model)
        base = None
        for n in sorted(gpu_counts):
            r = simulate_workload(model, hw.replace(num_gpus=n), w)
            base = base or r.tokens_per_s
            rows.append(ScalingRow(model, n, r.tokens_per_s, r.tokens_per_s / base, r.call.bubble_fraction))
    return rows


def scaling_markdown(rows: list[ScalingRow], hardware: str | HardwareProfile) -> str:
    hw = load_hardware(hardware)
    lines = [f"Simulated tokens/s on 1..N x {hw.name} (reference workload, one-step-stale optimizer)", "",
             "| model | GPUs | tokens/s (simulated) | speedup | efficiency | bubble |", "|---|---:|---:|---:|---:|---:|"]
    first = {}
    for r in rows:
        first.setdefault(r.model, r.num_gpus)
        eff = r.speedup * first[r.model] / r.num_gpus
        lines.append(f"| {r.model} | {r.num_gpus} | {r.tokens_per_s:,.0f} | {r.speedup:.2f}x | {eff:.0%} | {r.bubble:.0%} |")
    return "\n".join(lines)
