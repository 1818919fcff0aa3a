"""Simulated: QLoRA against bf16 LoRA in the planner (issue 44): upload bytes per step, and Qwen3-235B-A22B on 256 GB.

    python -m benchmarks.figures.qlora_plan [--quick]

1. Upload bytes per step at a Qwen3-8B shape (LoRA r16 on every projection, 8x RTX 4090, 4096-token
   sequences, 16 microbatches): the planner's plan of each run (``best_plan``, as ``sim plan`` picks
   it), and QLoRA on bf16 LoRA's plan (``--quick``: 1024 tokens, 8 microbatches, one balanced plan); the bytes of the
   simulator's uploads of one steady step, weights and activations apart, and its tokens/s.
2. Qwen3-235B-A22B QLoRA (``qwen3-235b-a22b-qlora``: NF4 base, LoRA r16 on q, k, v, o) on 8x RTX 4090
   with 256 GB of host RAM and the default headroom, 8 microbatches: ``sim plan``'s verdict, memory and
   predicted tokens/s at 8192 tokens and at the reference's 2048, beside the reference's measured bf16
   LoRA (r32 on every linear layer but the router, 64 sequences of 2048 in 10 microbatches: 1,820
   tokens/s, ``moe_presets.MEASURED``) and this simulator's reproduction of that run. The planner
   prices an MoE layer's routed FLOPs alone; the QLoRA plans are also re-simulated with the experts'
   dispatch priced (cost/moe_loop.py): ``grouped`` (the engine's ``moe_experts="grouped"``, one
   grouped GEMM per projection) and ``hf_eager_loop`` (Hugging Face's per-expert loop, what a model
   of per-expert ``Linear4bit`` layers runs). ``--quick`` prints the 8K verdict only (no simulation).
"""

from __future__ import annotations

import argparse
import dataclasses

from benchmarks.figures.moe_presets import MEASURED
from roundpipe_lab.analysis.workload import Workload, reference_plan, simulate_workload
from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.machine import override_profile
from lightning_roundpipe.cost.quantization import packed_costs
from lightning_roundpipe.cost.transformer import get_model_shape, shape_layer_costs
from lightning_roundpipe.planning.balanced import balanced_plan
from lightning_roundpipe.planning.capacity import DEFAULT_MEMORY_FRACTION, best_plan, plan_training
from lightning_roundpipe.planning.fit import fit_problems, host_headroom_bytes, model_costs
from lightning_roundpipe.sim.simulate import SimConfig, simulate_roundpipe

GiB, GB = 2**30, 1e9
QLORA_235B = "qwen3-235b-a22b-qlora"


def step_uploads(result, step: int = 1) -> tuple[int, int]:
    """(weight, activation) bytes the simulated step ``step`` uploads."""
    ups = [r for r in result.timeline if r.step == step and r.queue == "upload"]
    weights = sum(r.bytes for r in ups if r.kind == "weights")
    return weights, sum(r.bytes for r in ups) - weights


def upload_rows(seq_len: int, microbatches: int, planner: bool = True) -> list[dict]:
    """Part 1: Qwen3-8B LoRA r16, bf16 base and NF4 base, uploads and tokens/s of one simulated step
    (``planner`` False: both on one balanced plan of 4 stages per worker, a quick check)."""
    hw, shape = load_hardware("rtx4090"), get_model_shape("qwen3-8b")
    costs = {q: model_costs(shape, hw, seq_len, 1, 16, quantize=q) for q in (None, "nf4")}
    if planner:
        plans = {q: best_plan(costs[q], hw, [microbatches]).plan for q in costs}
        runs = (("bf16 LoRA r16", None, None), ("QLoRA r16 (NF4)", "nf4", "nf4"),
                ("QLoRA r16 (NF4), bf16 LoRA's plan", "nf4", None))
    else:
        plans = {None: balanced_plan(costs[None], 4 * hw.num_gpus, fused_last=True)}
        runs = (("bf16 LoRA r16", None, None), ("QLoRA r16 (NF4), the same plan", "nf4", None))
    rows = []
    for label, q, plan_of in runs:
        plan = plans[plan_of]
        result = simulate_roundpipe(plan, costs[q], hw, microbatches, config=SimConfig(steps=2))
        weights, acts = step_uploads(result)
        rows.append(dict(run=label, stages=f"{len(plan.forward)}F/{len(plan.dispatched_backward_stages())}B",
                         weights=weights, activations=acts, tokens_per_s=result.tokens_per_s))
    return rows


def verdict_235b(seq_len: int = 8192) -> str:
    """Part 2's fit check alone: the least-memory plans against 256 GB less the default headroom."""
    hw, _ = override_profile(load_hardware("rtx4090"), host_memory="256GB")
    budget = hw.host_memory_bytes - host_headroom_bytes(hw.host_memory_bytes)
    costs = model_costs(get_model_shape(QLORA_235B), hw, seq_len, 1, 16, quantize="nf4")
    problems, host, gpu = fit_problems(costs, hw, DEFAULT_MEMORY_FRACTION, 8, True, "stage", host_budget_bytes=budget)
    return (f"{QLORA_235B} r16 at {seq_len} tokens, 8 microbatches, 256 GB host: "
            f"{'fits' if not problems else 'does not fit: ' + '; '.join(problems)} (least-memory plan: host "
            f"{host.total / GiB:.1f} of {budget / GiB:.1f} GiB usable, worker {gpu / GiB:.1f} GiB)")


def dispatch_tokens_per_s(report, dispatch: str) -> float:
    """The plan of ``report`` re-simulated with an expert ``dispatch`` of cost/moe_loop.py priced (module doc)."""
    hw, shape = report.hardware, report.model
    costs = shape_layer_costs(shape, hw, report.seq_len, 1, lora_rank=report.lora_rank,
                              loss_chunk_tokens=report.loss_chunk_tokens, moe_dispatch=dispatch)
    costs = packed_costs(costs, shape, hw, "nf4")
    c = report.choice
    cfg = SimConfig(steps=2, layer_recompute=report.recompute == "layer")
    return simulate_roundpipe(c.plan, costs, hw, c.microbatches, config=cfg).tokens_per_s


def plan_rows_235b() -> list[str]:
    """Part 2: ``sim plan`` at 8192 and 2048 tokens, and the reference's measured and simulated bf16 LoRA."""
    hw, _ = override_profile(load_hardware("rtx4090"), host_memory="256GB")
    lines = []
    for seq in (8192, 2048):
        r = plan_training(QLORA_235B, hw, seq, lora_rank=16, microbatches=8, quantize="nf4", find_max_seq_len=False)
        c = r.choice
        lines.append(f"| QLoRA r16 on q, k, v, o (simulated, sim plan) | {seq} | {'fits' if r.fits else 'does not fit'} "
                     f"| {r.host.total / GiB:.1f} of {r.host_budget_bytes / GiB:.1f} GiB | "
                     f"{(c.gpu_bytes if c else r.min_gpu_bytes) / GiB:.1f} of {r.gpu_budget_bytes / GiB:.1f} GiB | "
                     + (f"{c.result.tokens_per_s:,.0f}; with the experts' dispatch priced: grouped "
                        f"{dispatch_tokens_per_s(r, 'grouped'):,.0f}, eager loop {dispatch_tokens_per_s(r, 'hf_eager_loop'):,.0f} |"
                        if c else "- |"))
    sequences, microbatches, measured = MEASURED[("qwen3-235b-a22b", 32)]
    workload = Workload(sequences, microbatches, 1, seq_len=2048, lora_rank=32)
    simulated = simulate_workload("qwen3-235b-a22b", "rtx4090", workload, plan=reference_plan("qwen3-235b-a22b"))
    lines.append(f"| reference bf16 LoRA r32, every linear layer but the router ({sequences} sequences, {microbatches} "
                 f"microbatches, reference partition, 800+ GB host) | 2048 | measured | - | - | {measured:,.0f} "
                 f"(this simulator: {simulated.tokens_per_s:,.0f}) |")
    head = ["| run on 8x RTX 4090 | tokens/sequence | verdict (256 GB host) | host needed of usable | "
            "worker needed of budget | tokens/s |", "|---|---:|---|---:|---:|---:|"]
    return head + lines


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="Qwen3-8B at 1024 tokens, 8 microbatches, one balanced plan; the 235B verdict only")
    args = p.parse_args(argv)
    seq, mb = (1024, 8) if args.quick else (4096, 16)
    out = [f"Upload bytes per step, Qwen3-8B LoRA r16, 8x RTX 4090, {seq}-token sequences, {mb} microbatches "
           f"(simulated):", "", "| run | plan | weights uploaded | activations uploaded | tokens/s |",
           "|---|---|---:|---:|---:|"]
    out += [f"| {r['run']} | {r['stages']} | {r['weights'] / GB:.1f} GB | {r['activations'] / GB:.2f} GB | "
            f"{r['tokens_per_s']:,.0f} |" for r in upload_rows(seq, mb, planner=not args.quick)]
    out += ["", verdict_235b()]
    if not args.quick:
        out += ["", "Qwen3-235B-A22B on 8x RTX 4090, 8 microbatches (QLoRA: qwen3-235b-a22b-qlora):", ""]
        out += plan_rows_235b()
    text = "\n".join(out)
    print(text)
    return text


if __name__ == "__main__":
    main()
