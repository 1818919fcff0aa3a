"""Simulated: the planner's longest trainable sequence, stage-grain versus layer-grain recompute.

For Qwen3-1.7B, Llama-3.1-8B and Qwen3-32B full fine-tuning and Qwen3-235B-A22B LoRA (rank 32
on every linear map but the router) on 8x RTX 4090 (``cost/profiles/rtx4090.yaml``) and on an
8x 80 GB A100 server with PCIe 4.0 host links (``a100.yaml``): the longest sequence (a multiple
of 256 tokens, one sequence per microbatch, 8 microbatches per step, the engine's chunked loss)
for which one of the planner's least-memory plans fits the workers (90% of their memory) and
the host (:func:`lightning_roundpipe.planning.capacity.longest_seq_len`), what stops one quantum more, and
the planner's recommended plan and predicted tokens/s at that length (``--throughput``).

    python benchmarks/figures/longest_sequences.py [--throughput] [--hardware rtx4090 a100]
"""

from __future__ import annotations

import argparse

from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.planning.capacity import longest_seq_len, plan_training

RUNS = (("qwen3-1.7b", None), ("llama-3.1-8b", None), ("qwen3-32b", None), ("qwen3-235b-a22b", 32))
PAPER_SEQ = 31 * 1024  # "LoRA on Qwen3-235B with 31K-token sequences on one 8x RTX 4090 server"
GiB = 2**30


def what_binds(model: str, hardware, seq: int, rank, grain: str) -> str:
    """Which memory one quantum past the longest sequence exceeds (from the planner's reasons)."""
    reasons = plan_training(model, hardware, seq, lora_rank=rank, recompute=grain, find_max_seq_len=False).reasons
    kinds = [r.split(":")[0] for r in reasons]
    # "no plan fits both memories": the finest plan overfills the host, coarser ones the workers
    return ", ".join(("GPU" if k.startswith("GPU") else "host" if k.startswith("host") else "GPU+host") for k in kinds)


def rows(hardware_names, throughput: bool, models=None):
    for name in hardware_names:
        hw = load_hardware(name)
        for model, rank in (run for run in RUNS if models is None or run[0] in models):
            row = {"hardware": name, "model": model, "mode": f"LoRA r{rank}" if rank else "full"}
            for grain in ("stage", "layer"):
                longest = longest_seq_len(model, hw, lora_rank=rank, recompute=grain)
                row[grain] = longest
                row[f"{grain}_binds"] = what_binds(model, hw, (longest or 0) + 256, rank, grain)
                if throughput and longest:
                    report = plan_training(model, hw, longest, lora_rank=rank, microbatches=hw.num_gpus,
                                           recompute=grain, find_max_seq_len=False)
                    c = report.choice
                    row[f"{grain}_tps"] = c.result.tokens_per_s if c else None
                    row[f"{grain}_plan"] = (f"{len(c.plan.forward)}F/{len(c.plan.dispatched_backward_stages())}B"
                                            if c else "-")
            yield row


def markdown(table, throughput: bool) -> str:
    head = "| server | model | training | longest, stage grain | binds | longest, layer grain | binds |"
    sep = "|---|---|---|---:|---|---:|---|"
    if throughput:
        head += " tokens/s at it, stage (plan) | tokens/s at it, layer (plan) |"
        sep += "---:|---:|"
    lines = [head, sep]
    for r in table:
        line = (f"| {r['hardware']} | {r['model']} | {r['mode']} | {r['stage'] or 'none'} | {r['stage_binds']} | "
                f"{r['layer'] or 'none'} | {r['layer_binds']} |")
        if throughput:
            line += "".join(f" {r.get(g + '_tps') or 0:,.0f} ({r.get(g + '_plan', '-')}) |" for g in ("stage", "layer"))
        lines.append(line)
    return "\n".join(lines)


def paper_check() -> str:
    report = plan_training("qwen3-235b-a22b", "rtx4090", PAPER_SEQ, lora_rank=32, microbatches=8,
                           find_max_seq_len=False)
    need = report.choice.gpu_bytes if report.choice else report.min_gpu_bytes
    tps = f", {report.choice.result.tokens_per_s:,.0f} tokens/s predicted" if report.choice else ""
    return (f"Qwen3-235B-A22B LoRA r32 at {PAPER_SEQ} tokens on 8x RTX 4090: {'fits' if report.fits else 'does not fit'} "
            f"({report.recompute} grain), worker {need / GiB:.1f} of {report.gpu_budget_bytes / GiB:.1f} GiB usable, "
            f"host {report.host.total / GiB:.0f} of {report.hardware.host_memory_bytes / GiB:.0f} GiB{tps}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", nargs="+", default=["rtx4090", "a100"])
    p.add_argument("--throughput", action="store_true", help="also simulate the recommended plan at each length")
    p.add_argument("--models", nargs="+", default=None, help="only these models (default: every run)")
    p.add_argument("--no-paper-check", action="store_true", help="leave out the Qwen3-235B-A22B line")
    a = p.parse_args(argv)
    print("Simulated (planner memory model, not measured): longest trainable sequence, 1 sequence per microbatch, "
          "8 microbatches, chunked loss of 1024 rows")
    print(markdown(list(rows(a.hardware, a.throughput, a.models)), a.throughput))
    if not a.no_paper_check:
        print(paper_check())


if __name__ == "__main__":
    main()
