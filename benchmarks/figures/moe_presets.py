"""Mixture-of-Experts presets: parameters, FLOPs per token, host memory and simulated tokens/s.

    python -m benchmarks.figures.moe_presets [--hardware rtx4090] [--seq-len 2048] [--lora-rank 32]

For Qwen3-30B-A3B, Qwen3-235B-A22B and GPT-OSS-20B, full fine-tuning and LoRA (rank 32 on
every linear layer but the router), prints the parameters held and run per token, the
training FLOPs per token (forward, recompute and backward of the routed path), the host
memory the run needs, whether the workers fit, and the simulated tokens/s of a
reference-style step (128 sequences for full fine-tuning, 64 for LoRA, 10 microbatches, one
call, one-step-stale host optimizer; the reference's own partition where the artifact
publishes one, else the planner's best plan). Every tokens/s is simulated; where the reference
published a measurement of the same run (GPT-OSS-20B full, 16 microbatches; Qwen3-235B-A22B
LoRA) it is printed beside it.

The shapes (``cost/transformer.py`` ``MODEL_PRESETS``) are the models' config.json values:
Qwen3-30B-A3B hidden 2048, 48 layers, 32 query / 4 KV heads of 128, 128 experts of
intermediate 768, top-8, vocabulary 151,936; Qwen3-235B-A22B hidden 4096, 94 layers, 64 / 4
heads of 128, 128 experts of 1536, top-8, vocabulary 151,936; GPT-OSS-20B hidden 2880, 24
layers, 64 / 8 heads of 64, 32 experts of 2880, top-4, vocabulary 201,088 (untied).
"""

from __future__ import annotations

import argparse

from lightning_roundpipe.cost.memory import host_bytes, roundpipe_gpu_bytes
from lightning_roundpipe.cost.transformer import get_model_shape, shape_layer_costs
from lightning_roundpipe.planning.capacity import DEFAULT_MEMORY_FRACTION
from lightning_roundpipe.cost.hardware import load_hardware
from roundpipe_lab.analysis.workload import REFERENCE_PARTITIONS, Workload, reference_plan, simulate_workload

MOE_PRESETS = ("qwen3-30b-a3b", "gpt-oss-20b", "qwen3-235b-a22b")
GB = 1e9
# The reference's measurements of these runs on 8x RTX 4090 (artifact exp/raw-data.csv; the
# workloads of roundpipe/run.sh): (LoRA rank or None, sequences, microbatches) -> tokens/s.
MEASURED = {("gpt-oss-20b", None): (128, 16, 18_121.59), ("qwen3-235b-a22b", 32): (64, 10, 1_819.61)}


def training_flops_per_token(model: str, seq_len: int, lora_rank: int | None) -> float:
    """Forward + recompute + backward FLOPs of one token through the decoder layers and the head."""
    from lightning_roundpipe.cost.transformer import decoder_layer_work, head_work

    shape = get_model_shape(model)
    fwd, bwd = decoder_layer_work(shape, seq_len, lora_rank)
    head_fwd, head_bwd = head_work(shape, lora_rank, chunked_loss=True)
    layer = 2 * (fwd.matmul_flops + fwd.attention_flops) + bwd.matmul_flops + bwd.attention_flops
    return shape.num_layers * layer + head_fwd.matmul_flops + head_bwd.matmul_flops


def rows(hardware: str = "rtx4090", seq_len: int = 2048, lora_rank: int = 32, models=None) -> list[dict]:
    hw = load_hardware(hardware)
    out = []
    for name in (m for m in MOE_PRESETS if models is None or m in models):
        s = get_model_shape(name)
        active = s.num_layers * s.active_linear_params() + s.vocab * s.hidden
        for rank in (None, lora_rank):
            sequences, microbatches, measured = MEASURED.get((name, rank), (128 if rank is None else 64, 10, None))
            workload = Workload(sequences, microbatches, 1, seq_len=seq_len, lora_rank=rank)
            costs = shape_layer_costs(s, hw, seq_len, workload.sequences_per_microbatch, lora_rank=rank,
                                      loss_chunk_tokens=workload.loss_chunk_tokens, fp16_accumulation=True)
            plan = reference_plan(name) if name in REFERENCE_PARTITIONS else None
            row = dict(model=s.name, params=s.num_params(), active=active, tuning="full" if rank is None else f"LoRA r{rank}",
                       flops=training_flops_per_token(name, seq_len, rank), sequences=sequences,
                       microbatches=microbatches, measured=measured)
            try:
                result = simulate_workload(name, hw, workload, plan=plan)
            except ValueError as err:  # the planner found no fitting plan
                row.update(host=host_bytes(costs).total, fits=False, tokens_per_s=None, note=str(err))
            else:
                gpu = max(roundpipe_gpu_bytes(result.plan, costs, hw.num_gpus))
                fits = gpu <= hw.gpu_memory_bytes * DEFAULT_MEMORY_FRACTION
                row.update(host=host_bytes(costs, result.plan, microbatches).total, fits=fits, gpu=gpu,
                           tokens_per_s=result.tokens_per_s, note="reference partition" if plan else "planner's plan")
            out.append(row)
    return out


def to_markdown(table: list[dict], hardware: str) -> str:
    hw = load_hardware(hardware)
    lines = [f"MoE presets on {hw.num_gpus}x {hw.name} (host {hw.host_memory_bytes / 2**30:.0f} GiB); tokens/s simulated", "",
             "| model | params | active/token | tuning | training GFLOP/token | host memory | worker peak | step | "
             "tokens/s (simulated) | measured (reference) |",
             "|---|---:|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in table:
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "does not fit"
        measured = f"{r['measured']:,.0f} ({r['tokens_per_s'] / r['measured'] - 1:+.0%})" if r["measured"] else "-"
        peak = f"{r['gpu'] / 2**30:.1f} GiB" + ("" if r["fits"] else " (over)") if "gpu" in r else "-"
        host = f"{r['host'] / GB:,.0f} GB" + (" (over)" if r["host"] > hw.host_memory_bytes else "")
        lines.append(f"| {r['model']} | {r['params'] / 1e9:.1f}B | {r['active'] / 1e9:.2f}B | {r['tuning']} | "
                     f"{r['flops'] / 1e9:.1f} | {host} | {peak} | {r['sequences']} seqs, "
                     f"{r['microbatches']} mb, {r['note']} | {tps} | {measured} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="rtx4090")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--models", nargs="+", default=None, choices=list(MOE_PRESETS), help="default: every preset")
    args = parser.parse_args(argv)
    print(to_markdown(rows(args.hardware, args.seq_len, args.lora_rank, args.models), args.hardware))


if __name__ == "__main__":
    main()
