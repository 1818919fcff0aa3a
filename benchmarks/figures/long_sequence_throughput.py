"""The reference's sequence-length sweep (Qwen3-1.7B, 8x RTX 4090), simulated beside its measurements.

    python -m benchmarks.figures.long_sequence_throughput

The reference artifact's ``roundpipe/run.sh`` ("4090 vary sequence length") trains Qwen3-1.7B
at 512 to 65,536 tokens per sequence, 10 microbatches, one call per step, stage-grain
recompute up to 16K and layer-grain beyond; ``exp/raw-data.csv`` holds the tokens/s. Each row
here is that workload on the simulator (the planner's plan, reference precision, its
optimizer one step stale), with the two long-sequence terms of issue 23 on: flash attention's
rate by length (``cost/attention.py``) and the reference's layer grain, whose layer inputs
come from the forward (``SimConfig.layer_inputs_from_forward``). The measurements were used as
a check only: no constant was set from them.
"""

from __future__ import annotations

import argparse

from roundpipe_lab.analysis.workload import Workload, simulate_workload
from lightning_roundpipe.cost.attention import attention_tflops_at
from lightning_roundpipe.cost.hardware import load_hardware

# seq_len -> (sequences per step, recompute grain, measured tokens/s): RoundPipe-artifact
# roundpipe/run.sh and exp/raw-data.csv ("seq len" row).
SWEEP = {512: (512, "stage", 68_101.64), 1024: (256, "stage", 67_783.21), 2048: (128, "stage", 65_416.83),
         4096: (60, "stage", 60_928.68), 8192: (30, "stage", 54_609.56), 16384: (10, "stage", 45_389.52),
         32768: (10, "layer", 33_722.51), 65536: (10, "layer", 23_734.40)}


def rows(hardware: str = "rtx4090", lengths=None) -> list[dict]:
    hw = load_hardware(hardware)
    out = []
    for seq_len, (sequences, grain, measured) in SWEEP.items():
        if lengths is not None and seq_len not in lengths:
            continue
        workload = Workload(sequences, 10, 1, seq_len=seq_len, recompute=grain)
        simulated = simulate_workload("qwen3-1.7b", hw, workload).tokens_per_s
        out.append(dict(seq_len=seq_len, sequences=sequences, recompute=grain, attention_tflops=attention_tflops_at(seq_len, hw),
                        simulated=simulated, measured=measured))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None, choices=list(SWEEP),
                        help="only these sequence lengths (default: the whole sweep)")
    args = parser.parse_args(argv)
    print("| tokens/sequence | sequences/step | recompute | attention TFLOP/s (model) | simulated | measured | error |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r in rows(lengths=args.lengths):
        print(f"| {r['seq_len']:,} | {r['sequences']} | {r['recompute']} | {r['attention_tflops']:.0f} | "
              f"{r['simulated']:,.0f} | {r['measured']:,.0f} | {r['simulated'] / r['measured'] - 1:+.1%} |")


if __name__ == "__main__":
    main()
