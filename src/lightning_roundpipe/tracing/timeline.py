"""Timelines of trace records: the command line, and the public functions in one import.

The engine records one ``TraceRecord`` per task; ``records`` measures how
well a step overlaps its work, ``chrome`` writes and reads Chrome / Perfetto traces and
``gantt`` draws a PNG. Everything is a pure function of the records.

Command line: ``python -m lightning_roundpipe.tracing.timeline trace.json --png out.png`` reads a trace
written by ``to_chrome_trace``, prints the per-step metrics and draws the chart.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from .chrome import from_chrome_trace, load_chrome_trace, to_chrome_trace
from .gantt import KIND_COLOURS, KIND_HATCHES, save_gantt_png
from .records import (bubble_fraction, exposed_transfer_seconds, hidden_share, step_metrics,
                      summarize_by_step)

__all__ = ["KIND_COLOURS", "KIND_HATCHES", "bubble_fraction",
           "exposed_transfer_seconds", "from_chrome_trace", "hidden_share", "load_chrome_trace", "main",
           "save_gantt_png", "step_metrics", "summarize_by_step", "to_chrome_trace"]


def _format_metrics(step: int, m: dict) -> str:
    line = (
        f"step {step}: {m['step_s'] * 1e3:.3f} ms, bubble {m['bubble_fraction']:.1%}, "
        f"exposed transfers {m['exposed_transfer_s'] * 1e3:.3f} ms, optimizer hidden {m['optim_hidden_share']:.1%}"
    )
    if m["tokens_per_s"] is not None:
        line += f", {m['tokens_per_s']:.1f} tokens/s"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print per-step metrics of a Chrome trace and optionally draw it as a PNG."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_roundpipe.tracing.timeline",
        description="Read a trace written by lightning_roundpipe.tracing.timeline.to_chrome_trace, "
        "print per-step metrics and optionally draw a Gantt chart.",
    )
    parser.add_argument("trace", help="Chrome trace JSON file")
    parser.add_argument("--png", help="write a Gantt chart PNG here")
    parser.add_argument("--title", help="chart title (default: the trace file name)")
    parser.add_argument("--tokens", type=int, help="tokens per step, to report throughput")
    args = parser.parse_args(argv)

    records = load_chrome_trace(args.trace)
    for step, metrics in summarize_by_step(records, args.tokens).items():
        print(_format_metrics(step, metrics))
    if args.png:
        save_gantt_png(records, args.png, title=args.title or Path(args.trace).name)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
