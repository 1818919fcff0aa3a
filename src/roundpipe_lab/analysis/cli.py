"""Command line of the simulator: ``python -m lightning_roundpipe.sim {plan,compare,paper,small-steps,scaling}``.

It lives in the analysis layer because it reaches every layer below (the capacity planner, the
bound-schedule baselines, the published runs); ``sim/__main__.py`` only runs ``main``. ``plan``
says whether training fits (exit 1 when it does not), ``compare``, ``paper`` and ``small-steps``
set RoundPipe beside other schedules and the published runs, ``scaling`` predicts 1..N GPUs and
``host-bytes`` prints host bytes per parameter. ``--num-gpus`` and the machine options
(``--detect``) replace the profile's figures. Each command: docs/design.md, design notes,
``analysis/cli.py``, and docs/planning.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Sequence

from ..cost.activations import DEFAULT_LOSS_CHUNK_TOKENS
from ..cost.hardware import available_hardware, load_hardware
from ..cost.hf_shape import resolve_model_shape, shape_summary
from ..cost.machine import (DEFAULT_DETECT_PROFILE, apply_detection, detect_machine, override_profile, profile_for_gpu,
                             size_in_gib)
from ..cost.quantization import QUANTIZE_CHOICES
from ..cost.transformer import LORA_TARGETS, MODEL_PRESETS
from ..planning.bytes_per_param import DEFAULT_MODEL as BYTES_MODEL, bytes_per_param_table
from ..planning.capacity import DEFAULT_MEMORY_FRACTION, plan_training
from .compare import PAPER_MODELS, compare_schedules, paper_table
from .paper import PUBLISHED_SEQ_LEN, paper_markdown, paper_rows
from .workload import PUBLISHED_RUNS
from .scaling import scaling_markdown, scaling_rows


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def add_machine_options(p: argparse.ArgumentParser) -> None:
    """The user's machine: overrides of the profile's fields, or ``--detect``."""
    p.add_argument("--gpus", "--num-gpus", dest="num_gpus", type=_positive, default=None,
                   help="GPU count (default: the profile's)")
    p.add_argument("--gpu-memory", default=None, help="memory of one GPU, GiB (or with a unit: '24GB')")
    p.add_argument("--host-memory", default=None, help="host RAM, GiB (or with a unit: '128GB')")
    p.add_argument("--pcie", default=None, help="host link per GPU: gen3, gen4, gen5 (x16) or GB/s")
    p.add_argument("--detect", action="store_true",
                   help="read GPUs (torch), host RAM and cores of this machine; the options above still override")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m lightning_roundpipe.sim`` and its subcommands."""
    hw_help = f"hardware profile name ({', '.join(available_hardware()) or 'see src/lightning_roundpipe/cost/profiles'}) or a YAML path"
    model_help = f"model preset ({', '.join(MODEL_PRESETS)})"
    local_model_help = model_help[:-1] + "), or a local Hugging Face model directory or config.json (never downloaded)"
    parser = argparse.ArgumentParser(prog="python -m lightning_roundpipe.sim",
                                     description="Simulate RoundPipe training steps, plan runs, compare schedules.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="say whether training fits and recommend microbatches, plan and sequence length")
    p.add_argument("--model", required=True, help=local_model_help)
    p.add_argument("--hardware", default=None, help=hw_help + " (required unless --detect)")
    p.add_argument("--seq-len", type=_positive, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--lora-rank", type=_positive, default=None, help="LoRA rank on all projections (default: full fine-tuning)")
    p.add_argument("--microbatch-size", type=_positive, default=1, help="sequences per microbatch (default 1)")
    p.add_argument("--microbatches", type=_positive, default=None, help="fix the microbatches per step (default: search)")
    p.add_argument("--loss-chunk", type=_positive, default=DEFAULT_LOSS_CHUNK_TOKENS,
                   help=f"rows of logits per chunk of the fused last stage's chunked cross-entropy "
                        f"(default {DEFAULT_LOSS_CHUNK_TOKENS}, as the engine's Hugging Face adapter)")
    p.add_argument("--full-logits", action="store_true", help="price the whole logits (a loss outside the pipeline)")
    p.add_argument("--recompute", choices=("auto", "stage", "layer"), default="auto",
                   help="recompute grain: auto (stage grain where it fits, else layer grain), stage or layer")
    p.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION,
                   help=f"usable share of each GPU's memory (default {DEFAULT_MEMORY_FRACTION})")
    p.add_argument("--no-max-seq", action="store_true", help="skip the longest-sequence search")
    p.add_argument("--host-headroom", default=None,
                   help="host RAM kept free for the OS and the data pipeline: GiB, with a unit ('16GB') or a share "
                        "of the RAM ('15%%') (default: 10%% of the RAM, at least 8 GiB)")
    p.add_argument("--no-optimizer-undo", action="store_true",
                   help="price optimizer_undo=False (no failed-step undo copy on the host)")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES + ("none",), default=None,
                   help="keep the frozen base weights packed (nf4: 4-bit NF4 with double-quantized block scales, "
                        "QLoRA; needs --lora-rank); default: the model's (a config's quantization_config, a "
                        "-qlora preset), none: price the base unpacked")
    p.add_argument("--lora-targets", choices=LORA_TARGETS, default=None,
                   help="linear maps LoRA adapts: all (every one but an MoE router) or attention (q, k, v, o); "
                        "default: the preset's (all, attention for a -qlora preset)")
    add_machine_options(p)

    b = sub.add_parser("host-bytes", help="host bytes per parameter of full fine-tuning, LoRA and QLoRA (a Markdown table)")
    b.add_argument("--model", default=BYTES_MODEL, help=model_help)
    b.add_argument("--hardware", default="rtx4090", help=hw_help + " (its compute dtype; host bytes do not depend on it)")

    c = sub.add_parser("compare", help="RoundPipe vs bound schedules with offload for one model")
    c.add_argument("--model", required=True, help=local_model_help)
    c.add_argument("--hardware", default="rtx4090", help=hw_help)
    c.add_argument("--seq-len", type=_positive, default=4096)
    c.add_argument("--microbatches", type=_positive, default=None, help="per step (default: 4 per GPU)")
    c.add_argument("--lora-rank", type=_positive, default=None)
    add_machine_options(c)

    w = sub.add_parser("paper", help="the paper's comparison on its published workload (reference, ours, baselines)")
    w.add_argument("--hardware", default="rtx4090", help=hw_help)
    w.add_argument("--seq-len", type=_positive, default=PUBLISHED_SEQ_LEN,
                   help=f"tokens per sequence (default {PUBLISHED_SEQ_LEN}, the published one; others have no measured figures)")
    w.add_argument("--models", nargs="+", default=[r.model for r in PUBLISHED_RUNS], help="published models")
    w.add_argument("--json", default=None, metavar="PATH",
                   help="also write the rows (model, system, simulated, measured, setting) as a JSON list")

    r = sub.add_parser("small-steps", help="RoundPipe vs bound schedules, Qwen3-1.7B/8B/32B, 32 single-sequence microbatches")
    r.add_argument("--hardware", default="rtx4090", help=hw_help)
    r.add_argument("--seq-len", type=_positive, default=4096)
    r.add_argument("--microbatches", type=_positive, default=None, help="per step (default: 4 per GPU)")
    r.add_argument("--models", nargs="+", default=list(PAPER_MODELS), help="model presets")
    r.add_argument("--num-gpus", type=_positive, default=None, help="GPU count (default: the profile's)")

    s = sub.add_parser("scaling", help="predicted tokens/s of the reference workload on 1..N GPUs")
    s.add_argument("--hardware", default="rtx4090", help=hw_help)
    s.add_argument("--models", nargs="+", default=["qwen3-1.7b", "llama-3.1-8b", "qwen3-32b"], help="model presets")
    s.add_argument("--gpus", nargs="+", type=_positive, default=[1, 2, 4, 8], help="GPU counts (default 1 2 4 8)")
    s.add_argument("--planner", action="store_true",
                   help="the planner's best plan at each count (default: the reference's partition where published)")
    return parser


def machine_of(args: argparse.Namespace) -> tuple:
    """The hardware profile the command runs on, and the lines saying what was assumed."""
    said: list[str] = []
    name = args.hardware
    if getattr(args, "detect", False):
        found = detect_machine()
        if name is None:
            name = profile_for_gpu(found.gpu_name)
            said.append(f"profile {name} (" + (f"matches {found.gpu_name}" if found.gpu_count else
                                               f"the default, {DEFAULT_DETECT_PROFILE}") + "; --hardware picks another)")
        hardware, detected = apply_detection(load_hardware(name), found)
        said += detected
    elif name is None:
        raise ValueError("--hardware is required (a profile name or YAML path), or pass --detect")
    else:
        hardware = load_hardware(name)
    if hasattr(args, "gpu_memory"):
        hardware, overridden = override_profile(hardware, gpus=args.num_gpus, gpu_memory=args.gpu_memory,
                                                host_memory=args.host_memory, pcie=args.pcie)
        said += overridden
    elif getattr(args, "num_gpus", None):
        hardware = hardware.replace(num_gpus=args.num_gpus)
    return hardware, said


def host_memory_source(args: argparse.Namespace, hardware) -> str:
    """Where the host RAM figure of ``plan`` comes from: the flag, ``--detect``, or the profile."""
    if getattr(args, "host_memory", None) is not None:
        return f"--host-memory {args.host_memory}"
    if getattr(args, "detect", False):
        return "--detect (this machine's RAM, or the profile's where it could not be read)"
    return f"the {hardware.name} profile, not your machine: pass --host-memory or --detect"


def headroom_bytes(text: str | None, host_memory_bytes: int) -> int | None:
    """``--host-headroom``: a share of the RAM ("15%"), GiB ("16") or a size with a unit ("16GB")."""
    if text is None:
        return None
    if text.strip().endswith("%"):
        return int(float(text.strip()[:-1]) / 100 * host_memory_bytes)
    return int(size_in_gib(text))


def quantize_of(args: argparse.Namespace, model) -> str | None:
    """``plan``'s packed base: ``--quantize`` where given ("none": unpacked), else the model's own."""
    if args.quantize is not None:
        return None if args.quantize == "none" else args.quantize
    return model.quantization


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        hardware, assumed = machine_of(args)
        model = None
        if hasattr(args, "model"):
            model, notes = resolve_model_shape(args.model)
            if getattr(args, "lora_targets", None):
                model = dataclasses.replace(model, lora_targets=args.lora_targets)
            if model.name.lower() != args.model.lower():
                assumed.append(f"model {model.name} from {args.model}: {shape_summary(model)}")
            assumed += [f"model {model.name}: {note}" for note in notes]
            if args.command == "compare" and model.quantization:
                assumed.append(f"model {model.name}: compare prices the base unpacked (sim plan prices its "
                               f"{model.quantization} base)")
        for line in assumed:
            print(f"Assumed: {line}")
        if args.command == "scaling":
            rows = scaling_rows(tuple(args.models), hardware, tuple(args.gpus), planner=args.planner)
            print(scaling_markdown(rows, hardware))
            return 0
        if args.command == "host-bytes":
            print(bytes_per_param_table(model, hardware))
            return 0
        if args.command == "plan":
            if quantize_of(args, model) and not args.lora_rank:
                raise ValueError(f"a packed {quantize_of(args, model)} base is frozen: give --lora-rank (QLoRA), or "
                                 f"--quantize none to price the base unpacked")
            report = plan_training(model, hardware, args.seq_len, microbatch_size=args.microbatch_size,
                                   lora_rank=args.lora_rank, microbatches=args.microbatches,
                                   loss_chunk_tokens=None if args.full_logits else args.loss_chunk,
                                   memory_fraction=args.memory_fraction, find_max_seq_len=not args.no_max_seq,
                                   recompute=args.recompute,
                                   host_headroom_bytes=headroom_bytes(args.host_headroom, hardware.host_memory_bytes),
                                   host_memory_source=host_memory_source(args, hardware),
                                   optimizer_undo=not args.no_optimizer_undo, quantize=quantize_of(args, model))
            print(report.to_text())
            return 0 if report.fits else 1
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


if __name__ == "__main__":
    sys.exit(main())
