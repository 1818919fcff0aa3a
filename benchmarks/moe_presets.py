"""Mixture-of-Experts presets: parameters, FLOPs per token, host memory and simulated tokens/s.

    python -m benchmarks.moe_presets [--hardware rtx4090] [--seq-len 2048] [--lora-rank 32]

For Qwen3-30B-A3B, Qwen3-235B-A22B and GPT-OSS-20B, full fine-tuning and LoRA (all linear
layers but the router), prints what the planner (:func:`plan_training`) says: whether it fits,
the host memory it needs and the predicted tokens/s of its recommended plan. Every tokens/s is
simulated.
"""

from __future__ import annotations

import argparse

import lightning_roundpipe.sim  # noqa: F401  (loads the simulator before the cost model it imports)
from lightning_roundpipe.cost.transformer import get_model_shape
from lightning_roundpipe.planning.fit import plan_training
from lightning_roundpipe.sim.hardware import load_hardware

MOE_PRESETS = ("qwen3-30b-a3b", "gpt-oss-20b", "qwen3-235b-a22b")
GB = 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="rtx4090")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lora-rank", type=int, default=32)
    args = parser.parse_args(argv)
    hw = load_hardware(args.hardware)
    print(f"MoE presets on {hw.num_gpus}x {hw.name} (host {hw.host_memory_bytes / 2**30:.0f} GiB), "
          f"{args.seq_len}-token sequences; tokens/s simulated")
    print()
    print("| model | params | active/token | tuning | host memory | fits | tokens/s (simulated) |")
    print("|---|---:|---:|---|---:|---|---:|")
    for name in MOE_PRESETS:
        s = get_model_shape(name)
        active = s.num_layers * s.active_linear_params() + s.vocab * s.hidden
        for rank in (None, args.lora_rank):
            report = plan_training(name, hw, args.seq_len, lora_rank=rank, find_max_seq_len=False)
            tps = f"{report.choice.result.tokens_per_s:,.0f}" if report.choice else "-"
            why = "yes" if report.fits else "no: " + "; ".join(report.reasons)[:80]
            tuning = "full" if rank is None else f"LoRA r{rank}"
            print(f"| {s.name} | {s.num_params() / 1e9:.1f}B | {active / 1e9:.2f}B | {tuning} | "
                  f"{report.host.total / GB:,.0f} GB | {why} | {tps} |", flush=True)


if __name__ == "__main__":
    main()
