"""GPT-OSS-20B on RTX 4090s, the reference's workload: tokens/s of each expert path, simulated.

    python -m benchmarks.figures.moe_expert_paths [--gpus 8 1] [--imbalance 1.0 1.25 1.5 2.0] [--json PATH]

The workload is the reference's published GPT-OSS-20B run (128 sequences of 2,048 tokens, 16
microbatches, one call, one-step-stale host optimizer, fp16 with fp16 accumulation; on 8 GPUs
the reference's own partition, on fewer the planner's plan). Per GPU count it prints the
reference's loop (``cost/moe_loop.py`` ``reference_loop``, measured 18,122 on 8 GPUs), the
grouped path (``grouped_mm``, bf16 only: at bf16, and under fp16 its capacity = tokens
fallback), the padded path (``moe_experts="padded_bmm"``, fp16) at each assumed load imbalance
(the busiest expert's load over the mean), the bound of a segmented GEMM that took fp16 (the
grouped path's terms at the fp16-accumulate rate: no padding, no host read), the routed-FLOP
bound (no dispatch cost, not even the rows' gather and scatter), and the
imbalance at which the padded path falls to 1.3x the loop. Then the per-layer terms of one
microbatch (16,384 tokens) on one GPU. Every figure is simulated.
"""

from __future__ import annotations

import dataclasses

from benchmarks.harness import cli, markdown_table, write_json
from roundpipe_lab.analysis.workload import Workload, reference_plan, simulate_workload
from lightning_roundpipe.cost import moe_loop
from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.transformer import get_model_shape

MODEL = "gpt-oss-20b"
SEQUENCES, MICROBATCHES = 128, 16  # the reference's GPT-OSS-20B run (artifact roundpipe/run.sh)
TARGET = 1.3  # issue 23: the grouped path at least 1.3x the reference's loop


def padded(imbalance: float) -> moe_loop.ExpertDispatch:
    return dataclasses.replace(moe_loop.for_shape("padded_bmm", MODEL), load_imbalance=imbalance)


def tokens_per_s(gpus: int, dispatch, fp16: bool = True) -> float:
    hw = dataclasses.replace(load_hardware("rtx4090"), num_gpus=gpus)
    plan = reference_plan(MODEL) if gpus == 8 else None
    workload = Workload(SEQUENCES, MICROBATCHES, 1, moe_dispatch=dispatch, fp16_accumulation=fp16)
    return simulate_workload(MODEL, hw, workload, plan=plan).tokens_per_s


def break_even(gpus: int, loop: float, low: float = 1.0, high: float = 3.0, steps: int = 7) -> float | None:
    """The largest imbalance (to 2^-steps of the range) at which the padded path is still >= TARGET x the loop."""
    if tokens_per_s(gpus, padded(low)) < TARGET * loop:
        return None
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if tokens_per_s(gpus, padded(middle)) >= TARGET * loop else (low, middle)
    return low


def path_rows(gpus: int, imbalances: list[float], break_even_steps: int = 7) -> list[dict]:
    loop = tokens_per_s(gpus, "reference_loop")
    rows = [dict(gpus=gpus, path="reference loop, fp16", tokens_per_s=loop),
            dict(gpus=gpus, path="grouped (grouped_mm), bf16", tokens_per_s=tokens_per_s(gpus, "grouped", fp16=False)),
            dict(gpus=gpus, path="grouped, fp16 (capacity = tokens fallback)", tokens_per_s=tokens_per_s(gpus, "grouped"))]
    rows += [dict(gpus=gpus, path=f"padded_bmm, fp16, imbalance {x:g}", tokens_per_s=tokens_per_s(gpus, padded(x)))
             for x in imbalances]
    segmented = dataclasses.replace(moe_loop.for_shape("grouped", MODEL), bf16_only=False)
    rows.append(dict(gpus=gpus, path="bound: a segmented GEMM taking fp16 (not built; no padding, no host read)",
                     tokens_per_s=tokens_per_s(gpus, segmented)))
    rows.append(dict(gpus=gpus, path="routed FLOPs only (no dispatch cost)", tokens_per_s=tokens_per_s(gpus, None)))
    for row in rows:
        row["over_loop"] = row["tokens_per_s"] / loop
    rows.append(dict(gpus=gpus, path=f"padded_bmm: largest imbalance still >= {TARGET}x", imbalance=break_even(gpus, loop, steps=break_even_steps)))
    return rows


def term_rows(tokens: int = SEQUENCES * 2048 // MICROBATCHES) -> list[dict]:
    """Per MoE layer and microbatch on one 4090: what each dispatch adds (device ms, host launch ms)."""
    hw, shape = load_hardware("rtx4090"), get_model_shape(MODEL)
    cases = [("reference loop", "reference_loop", True), ("grouped, bf16", "grouped", False),
             ("padded_bmm, imbalance 1.25", padded(1.25), True), ("padded_bmm, imbalance 1.0", padded(1.0), True)]
    out = []
    for name, dispatch, fp16 in cases:
        cost = moe_loop.dispatch_cost(shape, tokens, hw, moe_loop.for_shape(dispatch, MODEL), fp16_accumulation=fp16)
        out.append(dict(path=name, forward_ms=cost.forward_s * 1e3, backward_ms=cost.backward_s * 1e3,
                        device_ms=(2 * cost.forward_s + cost.backward_s) * 1e3,
                        host_launch_ms=(2 * cost.forward_launches + cost.backward_launches) * hw.launch_s * 1e3,
                        graph_bytes_per_token=cost.graph_bytes_per_token))
    return out


def main(argv=None) -> dict:
    parser = cli(__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--imbalance", type=float, nargs="+", default=[1.0, 1.25, 1.5, 2.0])
    parser.add_argument("--break-even-steps", type=int, default=7, help="bisection steps of the largest imbalance "
                        "still >= the target (each one simulation; 0: the range's low end only)")
    args = parser.parse_args(argv)
    rows = [row for gpus in args.gpus for row in path_rows(gpus, args.imbalance, args.break_even_steps)]
    terms = term_rows()
    print(f"{MODEL}, {SEQUENCES} x 2048 tokens in {MICROBATCHES} microbatches, RTX 4090s (simulated)")
    print(markdown_table(rows, [("gpus", "GPUs", "{}"), ("path", "experts path", "{}"),
                                ("tokens_per_s", "tokens/s", "{:,.0f}"), ("over_loop", "/ loop", "{:.2f}x"),
                                ("imbalance", "imbalance", "{:.2f}")]))
    print()
    print("per MoE layer and microbatch (16,384 tokens), what the dispatch adds; device = forward + recompute + backward")
    print(markdown_table(terms, [("path", "path", "{}"), ("forward_ms", "forward ms", "{:.2f}"),
                                 ("backward_ms", "backward ms", "{:.2f}"), ("device_ms", "device ms", "{:.2f}"),
                                 ("host_launch_ms", "host launches ms", "{:.2f}"),
                                 ("graph_bytes_per_token", "extra graph B/token", "{:,}")]))
    report = {"model": MODEL, "rows": rows, "terms": terms}
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
