"""The reference RoundPipe benchmark's rows, reproduced by the simulator beside the measured ones.

    python -m benchmarks.validation.published_gpu [--hardware rtx4090] [--planner] [--baselines]

For each model of the published 8x RTX 4090 table, simulates RoundPipe (one-step-stale
optimizer) and RoundPipe-sync (synchronous optimizer, more accumulation) on the reference
workload (:data:`roundpipe_lab.analysis.workload.PUBLISHED_RUNS`) with the hardware profile's
physical constants and the reference's own stage partitions
(:func:`~roundpipe_lab.analysis.workload.reference_plan`; ``--planner``: this project's
planner's best plan instead), and prints predicted and measured tokens/s with the error of
each figure. Every predicted number is simulated; the measured ones are the reference's.

``--baselines`` adds the bound schedules against their rows of the table (:func:`baseline_rows`):

- Megatron-PP-like: 1F1B over 8 GPUs with weights, gradients and Adam on the GPUs (no offload;
  18 bytes per trainable parameter: fp16 weight, fp32 gradient, fp32 master, m and v), the
  artifact's batches (512 / 256 sequences in microbatches of 4 / 2: megatron/run.sh), its
  update at the GPUs' memory bandwidth, matmuls at the fp32-accumulate rate (Megatron-Core's
  TransformerEngine GEMMs run cuBLASLt in fp32 compute; torch's fp16-accumulation flag does not
  reach them: an assumption, not measured);
- Mobius-like: ``mobius`` stages (``chunks`` x 8, streamed from host memory once per
  direction), 32 microbatches of one sequence per optimizer step (Mobius's configuration is not
  published: an assumption), the host optimizer synchronous and overlapped, the best fitting
  chunk count of 1-3.
"""

from __future__ import annotations

import argparse
import dataclasses

from lightning_roundpipe.cost.transformer import get_model_shape, shape_layer_costs
from lightning_roundpipe.cost.hardware import load_hardware
from roundpipe_lab.analysis.bound_schedules import simulate_bound
from lightning_roundpipe.sim.simulate import SimConfig
from lightning_roundpipe.cost.physical import matmul_tflops
from roundpipe_lab.analysis.workload import PUBLISHED_RUNS, reference_plan, simulate_workload

TARGET = 0.15  # the bound on each figure's relative error
BASELINE_TARGET = 0.25  # and on the bound baselines'
# Measured tokens/s of the baselines (exp/raw-data.csv of the artifact); None: out of memory.
MEGATRON_PP = {"qwen3-1.7b": (512, 4, 39_081), "llama-3.1-8b": (256, 2, 16_412), "qwen3-32b": (128, 1, None)}
MOBIUS = {"qwen3-1.7b": 39_370, "llama-3.1-8b": 11_288, "qwen3-32b": 2_552}
# Megatron's fp16 mixed precision on the GPU: fp32 gradient, master, m and v beside the fp16
# weight, i.e. 14 bytes per trainable parameter beyond the weight and gradient a GPU holds anyway.
MEGATRON_OPTIMIZER_BYTES = 14
MEGATRON_UPDATE_BYTES = 36  # a fused GPU Adam reads and writes those 18 bytes


def rows(hardware: str = "rtx4090", planner: bool = False, models=None) -> list[dict]:
    """One dict per (model, system): workload, simulated and measured tokens/s, relative error."""
    hw = load_hardware(hardware)
    out = []
    for run in (r for r in PUBLISHED_RUNS if models is None or r.model in models):
        plan = None if planner else reference_plan(run.model)
        for system, workload, measured in (("RoundPipe", run.stale, run.measured_stale),
                                           ("RoundPipe-sync", run.sync, run.measured_sync)):
            result = simulate_workload(run.model, hw, workload, plan=plan)
            out.append(dict(model=run.model, system=system, workload=workload, simulated=result.tokens_per_s,
                            measured=measured, error=result.tokens_per_s / measured - 1,
                            bubble=result.call.bubble_fraction, plan=result.plan.to_text()))
    return out


def fp16_held(costs):
    """``costs`` with every weight and gradient at 2 B on the GPU, as the baseline systems hold them
    (fp16 weights and gradients; Megatron's fp32 main gradient and Adam are its 14 extra bytes). The
    shape model prices RoundPipe's bf16-mixed instead (fp32 norms, fp32 leaves and gradients:
    cost/autocast_cast.py), which is not what these other systems keep on their GPUs."""
    layers = [dataclasses.replace(c, weight_bytes=2 * c.params, device_weight_bytes=None,
                                  grad_bytes=2 * (c.trainable_params or 0)) for c in costs.layers]
    return dataclasses.replace(costs, layers=layers)


def baseline_rows(hardware: str = "rtx4090") -> list[dict]:
    """Megatron-PP-like and Mobius-like simulations beside their published figures (see the module doc)."""
    hw = load_hardware(hardware)
    gpu_adam = hw.replace(host_memory_bytes_per_s=None,
                          cpu_optimizer_params_per_s=hw.num_gpus * hw.memory_bytes_per_s / MEGATRON_UPDATE_BYTES)
    out = []
    for model, (sequences, per_microbatch, measured) in MEGATRON_PP.items():
        costs = fp16_held(shape_layer_costs(get_model_shape(model), hw, 2048, per_microbatch, fp16_accumulation=False))
        r = simulate_bound("1f1b", costs, gpu_adam, sequences // per_microbatch, offload="resident",
                           optimizer_state_bytes_per_param=MEGATRON_OPTIMIZER_BYTES, config=SimConfig(steps=2))
        out.append(dict(model=model, system="Megatron-PP-like", simulated=r.tokens_per_s if r.fits else None,
                        measured=measured, peak_gib=max(r.notes["estimated_gpu_bytes"]) / 2**30,
                        note=f"1F1B, {sequences // per_microbatch} x {per_microbatch} sequences, Adam on the GPUs"))
    for model, measured in MOBIUS.items():
        costs = fp16_held(shape_layer_costs(get_model_shape(model), hw, 2048, 1, fp16_accumulation=True))
        for barrier in (True, False):
            best = None
            for chunks in (1, 2, 3):
                r = simulate_bound("mobius", costs, hw, 32, chunks_per_gpu=chunks,
                                   config=SimConfig(steps=3, optimizer_barrier=barrier))
                if r.fits and (best is None or r.tokens_per_s > best[1].tokens_per_s):
                    best = (chunks, r)
            optimizer = "synchronous" if barrier else "overlapped"
            out.append(dict(model=model, system=f"Mobius-like ({optimizer} optimizer)",
                            simulated=best[1].tokens_per_s if best else None, measured=measured,
                            peak_gib=max(best[1].notes["estimated_gpu_bytes"]) / 2**30 if best else None,
                            note=f"{best[0] * hw.num_gpus} streamed stages, 32 x 1 sequence" if best else "no chunking fits"))
    for r in out:
        sim, meas = r["simulated"], r["measured"]
        r["error"] = sim / meas - 1 if sim is not None and meas is not None else None
    return out


def baselines_markdown(table: list[dict]) -> str:
    lines = ["| model | system | simulated | measured | error | peak GPU (GiB) | setting |", "|---|---|---:|---:|---:|---:|---|"]
    for r in table:
        sim = f"{r['simulated']:,.0f}" if r["simulated"] is not None else "OOM"
        meas = f"{r['measured']:,}" if r["measured"] is not None else "OOM"
        err = f"{r['error']:+.1%}" if r["error"] is not None else ("match" if sim == meas else "-")
        if r["error"] is not None and abs(r["error"]) > BASELINE_TARGET:
            err += " (over 25%)"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        lines.append(f"| {r['model']} | {r['system']} | {sim} | {meas} | {err} | {peak} | {r['note']} |")
    return "\n".join(lines)


def to_markdown(table: list[dict], hardware: str) -> str:
    hw = load_hardware(hardware)
    lines = [f"Reference workload on {hw.num_gpus}x {hw.name}: simulated vs measured tokens/s", "",
             "| model | system | seqs/step | microbatches x calls | simulated | measured | error | bubble |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        w = r["workload"]
        flag = "" if abs(r["error"]) <= TARGET else " (over 15%)"
        lines.append(f"| {r['model']} | {r['system']} | {w.sequences_per_step} | {w.microbatches} x {w.calls} | "
                     f"{r['simulated']:,.0f} | {r['measured']:,} | {r['error']:+.1%}{flag} | {r['bubble']:.0%} |")
    host = (f"{hw.host_memory_bytes_per_s / 1e9:.0f} GB/s host memory / {hw.optimizer_bytes_per_param:g} B per update"
            if hw.host_memory_bytes_per_s else "")
    lines += ["", f"Constants: matmul {matmul_tflops(hw, True):g} TFLOP/s fp16-acc (peak {hw.tensor_tflops_fp16_acc}), "
              f"flash attention {hw.attention_tflops or hw.tensor_tflops_fp32_acc:g} TFLOP/s, memory "
              f"{hw.memory_bytes_per_s / 1e9:.0f} GB/s, PCIe {hw.host_device_bytes_per_s / 1e9:.0f} GB/s, host optimizer "
              f"{hw.optimizer_params_per_s:.3g} params/s ({host}) (src/lightning_roundpipe/cost/profiles/{hw.name}.yaml)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="rtx4090")
    parser.add_argument("--planner", action="store_true", help="this project's planner's plans, not the reference's")
    parser.add_argument("--baselines", action="store_true", help="also the Megatron-PP-like and Mobius-like rows")
    parser.add_argument("--models", nargs="+", default=None, help="only these of the published models (default: all)")
    args = parser.parse_args(argv)
    print(to_markdown(rows(args.hardware, args.planner, args.models), args.hardware))
    if args.baselines:
        print()
        print(baselines_markdown(baseline_rows(args.hardware)))


if __name__ == "__main__":
    main()
