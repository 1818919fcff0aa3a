"""What every benchmark shares: its command line's common flags and its report (markdown table, JSON).

- :func:`cli`: an ``argparse`` parser with the flags every script spells the same way
  (``--json PATH``, and ``--quick`` where the script has a short mode);
- :func:`write_json`: the JSON report, strict (NaN becomes null) and naming its producer (the
  module that wrote it, ``"producer": "benchmarks.calibration.dispatch_cost"``), so a figure
  copied into a profile or a doc can be traced back to the script that measured it;
- :func:`markdown_table`, :func:`run_info`, :func:`load_line`: the printed side;
- :func:`cpu_seconds_by_thread_name`: this process's CPU seconds per thread (Linux ``/proc``), for
  the scripts that split host CPU between the pool's threads.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]  # what producer names are relative to


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


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table with one line per row; ``columns`` are (key in a row dict, column title, format).
    Missing or NaN values print as ``-``."""
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


def cli(description: str, *, quick: str | None = None, json_help: str | None = "also write the results to this JSON file",
           json_default: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """A benchmark's parser with the common flags: ``--json PATH`` (unless ``json_help`` is None) and,
    when ``quick`` (its help text) is given, ``--quick``. ``kwargs`` go to ``ArgumentParser``."""
    p = argparse.ArgumentParser(description=description, **kwargs)
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    if json_help is not None:
        p.add_argument("--json", metavar="PATH", default=json_default, help=json_help)
    return p


def producer_name(file: str | Path) -> str:
    """The dotted module name of a file under the repository (what ``python -m`` runs), else its path."""
    path = Path(file).resolve()
    try:
        return ".".join(path.relative_to(REPO).with_suffix("").parts)
    except ValueError:
        return str(path)


def write_json(path: str | Path, payload: dict, producer: str | None = None) -> None:
    """Write ``payload`` as strict JSON (NaN becomes null, other objects their ``str``), creating parent folders.

    The file names its producer: ``producer``, else the module that called this function (read from
    the caller's frame, so a script run as a file, as a module or through its old name's shim
    records the same name). A payload that already has a ``"producer"`` keeps it.
    """
    if producer is None:
        caller = inspect.currentframe().f_back
        producer = producer_name(caller.f_globals.get("__file__", "?"))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable({"producer": producer, **payload}), indent=2, sort_keys=False, default=str) + "\n")


def run_info(load_before: Sequence[float], started: float) -> dict:
    """What a measurement script stores about the machine around a run: load averages before and
    now, seconds since ``started`` (``time.perf_counter``), CPU count."""
    return {"loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
            "elapsed_s": time.perf_counter() - started, "cpus": os.cpu_count()}


def load_line(info: dict) -> str:
    """The one-line summary of :func:`run_info`'s fields printed under a result table."""
    return (f"load average before {info['loadavg_before'][0]:.2f}, after {info['loadavg_after'][0]:.2f} "
            f"({info['cpus']} CPUs); {info['elapsed_s']:.0f} s")


def cpu_seconds_by_thread_name() -> dict[str, float]:
    """CPU seconds (user + system) each thread of this process has used so far, by its ``threading`` name
    (Linux ``/proc``; threads of one name summed, threads ``threading`` does not know under ``""``).
    Subtract two readings for an interval."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    seconds: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        name = names.get(int(tid), "")
        seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return seconds
