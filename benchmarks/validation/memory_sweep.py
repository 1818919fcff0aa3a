"""Predicted versus measured per-worker device memory, over sequence lengths, plans, fused or not, LoRA or full.

Each case builds a narrow Hugging Face causal LM (Qwen3 or Llama) from a config, saves it and
loads it back with ``from_pretrained`` (the real loading path), pipelines it on the CPU backend
with memory measuring on (``workers/device_memory.py``), trains one step and compares each
worker's measured peak with the planner's prediction, ``cost.memory.roundpipe_gpu_bytes`` over
the cost profile the planner uses for that shape (``cost.transformer.shape_layer_costs``, fp32).

    PYTHONPATH=src python -m benchmarks.validation.memory_sweep            # the full sweep (256 to 16K tokens)
    PYTHONPATH=src python -m benchmarks.validation.memory_sweep --quick    # the test's subset

Prints one line per case: the plan's peak (the busiest worker, what a per-worker cap must hold)
measured and predicted, and the largest error over the workers. The worst error of the plan's
peak is the bound the test holds to 10%; a lighter worker's peak also depends on whether the next
microbatch's input, computed by another worker, has arrived when its compute peaks (a race the
model decides from the stages' compute times), so its error is reported beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` and ``tests`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import cli, write_json  # noqa: E402
from tests._memory_cases import ERROR_BOUND, MemoryCase, compare, run_case, sweep_cases  # noqa: E402,F401


def tally_overhead(case: MemoryCase, steps: int = 6, rounds: int = 3) -> float:
    """Step time with memory measuring over step time without, same case, rounds interleaved in one
    process (the median step of each run, the first step left out: it warms up)."""
    ratios = []
    for _ in range(rounds):
        plain, measured = [], []
        run_case(case, steps=steps, measure=False, seconds=plain)
        run_case(case, steps=steps, measure=True, seconds=measured)
        ratios.append(sorted(measured[1:])[len(measured[1:]) // 2] / sorted(plain[1:])[len(plain[1:]) // 2])
    return sorted(ratios)[len(ratios) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = cli(__doc__.splitlines()[0], quick="only the test's subset", json_help="write every case's figures to this file")
    parser.add_argument("--overhead", action="store_true", help="only time measuring against not measuring")
    parser.add_argument("--cases", type=int, default=None, help="only the first CASES cases (the smoke test: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.overhead:
        for case in (MemoryCase(seq_len=256), MemoryCase(seq_len=2048, hidden=64)):
            print(f"{case.label}: step time measuring / not measuring = {tally_overhead(case):.2f}x", flush=True)
        return
    rows = []
    for case in sweep_cases(args.quick)[:args.cases]:
        row = compare(case)
        rows.append(row)
        print(f"{row['case']:<80} measured {max(row['measured']) / 2**20:8.2f} MiB  predicted "
              f"{max(row['predicted']) / 2**20:8.2f} MiB  error {row['max_error']:+.1%}  "
              f"(largest over the workers {row['worst_error']:+.1%})", flush=True)
    worst = max(rows, key=lambda r: abs(r["max_error"]))
    worker = max(rows, key=lambda r: abs(r["worst_error"]))
    print(f"worst error of the plan's peak over {len(rows)} cases: {worst['max_error']:+.1%} ({worst['case']}); "
          f"bound {ERROR_BOUND:.0%}")
    print(f"worst error of any worker's peak: {worker['worst_error']:+.1%} ({worker['case']})")
    if args.json:
        write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
