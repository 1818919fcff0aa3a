"""Rows of benchmark results as a markdown table and as JSON (shared by the CPU and GPU scripts)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

# (key in a row dict, column title, format)
CPU_COLUMNS: list[tuple[str, str, str]] = [
    ("shape", "shape", "{}"),
    ("system", "system", "{}"),
    ("recompute", "recompute", "{}"),
    ("step_s", "step s", "{:.3f}"),
    ("model_step_s", "model step s", "{:.3f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("ratio_vs_1f1b", "vs 1F1B", "{:.2f}x"),
    ("ideal_ratio_vs_1f1b", "ideal vs 1F1B", "{:.2f}x"),
    ("balance_ratio_vs_1f1b", "balance bound vs 1F1B", "{:.2f}x"),
    ("peak_rss_mib", "peak RSS MiB", "{:.0f}"),
    ("extra_rss_mib", "extra MiB", "{:.0f}"),
    ("bubble", "bubble", "{:.1%}"),
    ("other_load", "other load (cores)", "{:.2f}"),
]


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]] = CPU_COLUMNS) -> str:
    """A markdown table with one line per row; missing or NaN values print as ``-``."""
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(key), fmt) for key, _, fmt in columns) + " |")
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None  # strict JSON has no NaN
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: str | Path, payload: dict) -> None:
    """Write ``payload`` as strict JSON (NaN becomes null), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(payload), indent=2, sort_keys=False) + "\n")


def run_info(load_before: Sequence[float], started: float) -> dict:
    """What a measurement script stores about the machine around a run: load averages before and
    now, seconds since ``started`` (``time.perf_counter``), CPU count."""
    return {"loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
            "elapsed_s": time.perf_counter() - started, "cpus": os.cpu_count()}


def load_line(info: dict) -> str:
    """The one-line summary of :func:`run_info`'s fields printed under a result table."""
    return (f"load average before {info['loadavg_before'][0]:.2f}, after {info['loadavg_after'][0]:.2f} "
            f"({info['cpus']} CPUs); {info['elapsed_s']:.0f} s")
