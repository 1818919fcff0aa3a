"""The planner's command line: ``python -m lightning_roundpipe.plan`` says whether fine-tuning fits a machine.

It prints the plan report of ``capacity.plan_training`` (exit 1 when the run does not fit) or, with
``--host-bytes``, host bytes per parameter of full fine-tuning, LoRA and QLoRA. The machine is a
hardware profile whose figures ``--gpus``, ``--gpu-memory``, ``--host-memory``, ``--pcie`` and
``--detect`` replace. ``python -m lightning_roundpipe.plan`` and ``... sim host-bytes`` still run
it (the old names); the lab's studies have their own command (``python -m roundpipe_lab.sim``).
Each flag: docs/planning.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Sequence

from ..cost.activations import DEFAULT_LOSS_CHUNK_TOKENS
from ..cost.hardware import available_hardware, load_hardware
from ..cost.hf_shape import resolve_model_shape, shape_summary
from ..cost.machine import (DEFAULT_DETECT_PROFILE, apply_detection, detect_machine, override_profile, profile_for_gpu,
                            size_in_gib)
from ..cost.quantization import QUANTIZE_CHOICES
from ..cost.transformer import LORA_TARGETS, MODEL_PRESETS
from .bytes_per_param import DEFAULT_MODEL as BYTES_MODEL, bytes_per_param_table
from .capacity import DEFAULT_MEMORY_FRACTION, plan_training

PROG = "python -m lightning_roundpipe.plan"
HOST_BYTES_HARDWARE = "rtx4090"  # --host-bytes' default profile: its compute dtype only (host bytes do not depend on it)


def positive_int(text: str) -> int:
    """An argparse type: a positive integer."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def hardware_help() -> str:
    """The help of a ``--hardware`` option: the profiles there are."""
    return f"hardware profile name ({', '.join(available_hardware()) or 'see src/lightning_roundpipe/cost/profiles'}) or a YAML path"


def model_help(local: bool = True) -> str:
    """The help of a ``--model`` option: the presets, and (``local``) a local Hugging Face model."""
    text = f"model preset ({', '.join(MODEL_PRESETS)}"
    return text + ("), or a local Hugging Face model directory or config.json (never downloaded)" if local else ")")


def add_machine_options(p: argparse.ArgumentParser) -> None:
    """The user's machine: overrides of the profile's fields, or ``--detect``."""
    p.add_argument("--gpus", "--num-gpus", dest="num_gpus", type=positive_int, default=None,
                   help="GPU count (default: the profile's)")
    p.add_argument("--gpu-memory", default=None, help="memory of one GPU, GiB (or with a unit: '24GB')")
    p.add_argument("--host-memory", default=None, help="host RAM, GiB (or with a unit: '128GB')")
    p.add_argument("--pcie", default=None, help="host link per GPU: gen3, gen4, gen5 (x16) or GB/s")
    p.add_argument("--detect", action="store_true",
                   help="read GPUs (torch), host RAM and cores of this machine; the options above still override")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The plan's options (``--model`` given, ``--hardware`` or ``--detect``) and the machine's."""
    p.add_argument("--model", default=None, help=model_help() + f"; required unless --host-bytes (default {BYTES_MODEL})")
    p.add_argument("--hardware", default=None, help=hardware_help() + " (required unless --detect or --host-bytes)")
    p.add_argument("--seq-len", type=positive_int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--lora-rank", type=positive_int, default=None, help="LoRA rank on all projections (default: full fine-tuning)")
    p.add_argument("--microbatch-size", type=positive_int, default=1, help="sequences per microbatch (default 1)")
    p.add_argument("--microbatches", type=positive_int, default=None, help="fix the microbatches per step (default: search)")
    p.add_argument("--loss-chunk", type=positive_int, default=DEFAULT_LOSS_CHUNK_TOKENS,
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


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The argument parser of ``python -m lightning_roundpipe.plan``."""
    parser = argparse.ArgumentParser(prog=prog, description="Say whether fine-tuning fits this machine and recommend "
                                                            "microbatches, plan and sequence length.")
    add_plan_arguments(parser)
    parser.add_argument("--host-bytes", action="store_true",
                        help="print host bytes per parameter of full fine-tuning, LoRA and QLoRA instead (a Markdown "
                             f"table; --model and --hardware default to {BYTES_MODEL} and {HOST_BYTES_HARDWARE}, the "
                             "plan's other options are not used)")
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


def model_of(args: argparse.Namespace, assumed: list[str]):
    """The model shape of ``--model`` (a preset or a local Hugging Face config); appends what was assumed."""
    model, notes = resolve_model_shape(args.model)
    if getattr(args, "lora_targets", None):
        model = dataclasses.replace(model, lora_targets=args.lora_targets)
    if model.name.lower() != args.model.lower():
        assumed.append(f"model {model.name} from {args.model}: {shape_summary(model)}")
    assumed += [f"model {model.name}: {note}" for note in notes]
    return model


def host_memory_source(args: argparse.Namespace, hardware) -> str:
    """Where the host RAM figure of the plan comes from: the flag, ``--detect``, or the profile."""
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
    """The plan's packed base: ``--quantize`` where given ("none": unpacked), else the model's own."""
    if args.quantize is not None:
        return None if args.quantize == "none" else args.quantize
    return model.quantization


def run_plan(args: argparse.Namespace, model, hardware) -> int:
    """Print the plan report; 0 when training fits, 1 when it does not."""
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


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the command line; returns the exit status (2 for bad input, with the reason on stderr)."""
    args = build_parser(prog).parse_args(argv)
    try:
        if args.host_bytes:
            args.model = args.model or BYTES_MODEL
            if args.hardware is None and not args.detect:
                args.hardware = HOST_BYTES_HARDWARE
        elif args.model is None:
            raise ValueError("--model is required (a preset name or a local Hugging Face model), or pass --host-bytes")
        hardware, assumed = machine_of(args)
        model = model_of(args, assumed)
        for line in assumed:
            print(f"Assumed: {line}")
        if args.host_bytes:
            print(bytes_per_param_table(model, hardware))
            return 0
        return run_plan(args, model, hardware)
    except (KeyError, FileNotFoundError, ValueError) as err:
        print(f"error: {err.args[0] if isinstance(err, KeyError) else err}", file=sys.stderr)
        return 2

