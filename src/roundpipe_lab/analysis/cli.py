"""The lab's command line: ``python -m roundpipe_lab.sim {plan,host-bytes,compare,paper,small-steps,scaling}``.

``compare``, ``paper`` and ``small-steps`` set RoundPipe beside other schedules and the published runs,
``scaling`` predicts 1..N GPUs. ``plan`` and ``host-bytes`` are the library's planner
(``python -m lightning_roundpipe.plan``, ``... --host-bytes``), kept here under their old names.
``--num-gpus`` and the machine options (``--detect``) replace the profile's figures. Each command:
docs/simulator.md and docs/planning.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from lightning_roundpipe.planning.cli import (add_machine_options, hardware_help, machine_of, model_help, model_of,
                                              positive_int)
from lightning_roundpipe.planning.cli import main as plan_main
from .compare import PAPER_MODELS, compare_schedules, paper_table
from .paper import PUBLISHED_SEQ_LEN, paper_markdown, paper_rows
from .workload import PUBLISHED_RUNS
from .scaling import scaling_markdown, scaling_rows

PROG = "python -m roundpipe_lab.sim"
PLANNER_COMMANDS = {"plan": [], "host-bytes": ["--host-bytes"]}  # the library's planner: its flags after these


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the lab's studies (``plan`` and ``host-bytes`` are the planner's: ``main``)."""
    parser = argparse.ArgumentParser(prog=PROG, description="Simulate RoundPipe training steps, compare schedules, "
                                                            "reproduce published runs; plan runs (the library's planner).")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", help="the library's planner: python -m lightning_roundpipe.plan (same options)", add_help=False)
    sub.add_parser("host-bytes", help="python -m lightning_roundpipe.plan --host-bytes (same options)", add_help=False)

    c = sub.add_parser("compare", help="RoundPipe vs bound schedules with offload for one model")
    c.add_argument("--model", required=True, help=model_help())
    c.add_argument("--hardware", default="rtx4090", help=hardware_help())
    c.add_argument("--seq-len", type=positive_int, default=4096)
    c.add_argument("--microbatches", type=positive_int, default=None, help="per step (default: 4 per GPU)")
    c.add_argument("--lora-rank", type=positive_int, default=None)
    add_machine_options(c)

    w = sub.add_parser("paper", help="the paper's comparison on its published workload (reference, ours, baselines)")
    w.add_argument("--hardware", default="rtx4090", help=hardware_help())
    w.add_argument("--seq-len", type=positive_int, default=PUBLISHED_SEQ_LEN,
                   help=f"tokens per sequence (default {PUBLISHED_SEQ_LEN}, the published one; others have no measured figures)")
    w.add_argument("--models", nargs="+", default=[r.model for r in PUBLISHED_RUNS], help="published models")
    w.add_argument("--json", default=None, metavar="PATH",
                   help="also write the rows (model, system, simulated, measured, setting) as a JSON list")

    r = sub.add_parser("small-steps", help="RoundPipe vs bound schedules, Qwen3-1.7B/8B/32B, 32 single-sequence microbatches")
    r.add_argument("--hardware", default="rtx4090", help=hardware_help())
    r.add_argument("--seq-len", type=positive_int, default=4096)
    r.add_argument("--microbatches", type=positive_int, default=None, help="per step (default: 4 per GPU)")
    r.add_argument("--models", nargs="+", default=list(PAPER_MODELS), help="model presets")
    r.add_argument("--num-gpus", type=positive_int, default=None, help="GPU count (default: the profile's)")

    s = sub.add_parser("scaling", help="predicted tokens/s of the reference workload on 1..N GPUs")
    s.add_argument("--hardware", default="rtx4090", help=hardware_help())
    s.add_argument("--models", nargs="+", default=["qwen3-1.7b", "llama-3.1-8b", "qwen3-32b"], help="model presets")
    s.add_argument("--gpus", nargs="+", type=positive_int, default=[1, 2, 4, 8], help="GPU counts (default 1 2 4 8)")
    s.add_argument("--planner", action="store_true",
                   help="the planner's best plan at each count (default: the reference's partition where published)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PLANNER_COMMANDS:
        return plan_main(PLANNER_COMMANDS[argv[0]] + argv[1:], prog=f"{PROG} {argv[0]}")
    args = build_parser().parse_args(argv)
    try:
        hardware, assumed = machine_of(args)
        model = model_of(args, assumed) if hasattr(args, "model") else None
        if args.command == "compare" and model.quantization:
            assumed.append(f"model {model.name}: compare prices the base unpacked (sim plan prices its "
                           f"{model.quantization} base)")
        for line in assumed:
            print(f"Assumed: {line}")
        if args.command == "scaling":
            rows = scaling_rows(tuple(args.models), hardware, tuple(args.gpus), planner=args.planner)
            print(scaling_markdown(rows, hardware))
            return 0
        if args.command == "compare":
            table = compare_schedules(model, hardware, args.seq_len, microbatches=args.microbatches,
                                      lora_rank=args.lora_rank)
            print(table.to_markdown())
            return 0
        if args.command == "paper":
            rows = paper_rows(hardware, tuple(args.models), args.seq_len)
            print(paper_markdown(rows, hardware, args.seq_len))
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
            return 0
        print(paper_table(hardware, tuple(args.models), args.seq_len, args.microbatches))
        return 0
    except (KeyError, FileNotFoundError, ValueError) as err:
        print(f"error: {err.args[0] if isinstance(err, KeyError) else err}", file=sys.stderr)
        return 2
