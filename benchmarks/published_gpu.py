"""The reference RoundPipe benchmark's rows, reproduced by the simulator beside the measured ones.

    python -m benchmarks.published_gpu [--hardware rtx4090] [--planner]

For each model of the published 8x RTX 4090 table, simulates RoundPipe (one-step-stale
optimizer) and RoundPipe-sync (synchronous optimizer, more accumulation) on the reference
workload (:data:`lightning_roundpipe.sim.workload.PUBLISHED_RUNS`) with the hardware profile's
physical constants and the reference's own stage partitions
(:func:`~lightning_roundpipe.sim.workload.reference_plan`; ``--planner``: this project's
planner's best plan instead), and prints predicted and measured tokens/s with the error of
each figure. Every predicted number is simulated; the measured ones are the reference's.
"""

from __future__ import annotations

import argparse

from lightning_roundpipe.sim.hardware import load_hardware
from lightning_roundpipe.sim.physical import matmul_tflops
from lightning_roundpipe.sim.workload import PUBLISHED_RUNS, reference_plan, simulate_workload

TARGET = 0.15  # the bound on each figure's relative error


def rows(hardware: str = "rtx4090", planner: bool = False) -> list[dict]:
    """One dict per (model, system): workload, simulated and measured tokens/s, relative error."""
    hw = load_hardware(hardware)
    out = []
    for run in PUBLISHED_RUNS:
        plan = None if planner else reference_plan(run.model)
        for system, workload, measured in (("RoundPipe", run.stale, run.measured_stale),
                                           ("RoundPipe-sync", run.sync, run.measured_sync)):
            result = simulate_workload(run.model, hw, workload, plan=plan)
            out.append(dict(model=run.model, system=system, workload=workload, simulated=result.tokens_per_s,
                            measured=measured, error=result.tokens_per_s / measured - 1,
                            bubble=result.call.bubble_fraction, plan=result.plan.to_text()))
    return out


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
              f"{hw.optimizer_params_per_s:.3g} params/s ({host}) (src/lightning_roundpipe/sim/profiles/{hw.name}.yaml)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="rtx4090")
    parser.add_argument("--planner", action="store_true", help="this project's planner's plans, not the reference's")
    args = parser.parse_args(argv)
    print(to_markdown(rows(args.hardware, args.planner), args.hardware))


if __name__ == "__main__":
    main()
