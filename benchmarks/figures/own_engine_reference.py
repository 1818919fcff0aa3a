"""This project's engine on the reference benchmark's workload, beside the reference's figures (simulated).

    python -m benchmarks.figures.own_engine_reference [--hardware rtx4090] [--models qwen3-1.7b ...] [--no-best]
                                              [--json own_engine_reference.json]
    python -m benchmarks.figures.own_engine_reference --quick [--json PATH]   # minutes: the configs only

``--quick`` prints only the configurations of ``roundpipe_lab.analysis.paper`` (every one on
the reference's partition, no plan search, two optimizer steps): ``reference_setup``,
``default``, ``best_exact`` and ``best_exact_reference_precision``, each with its tokens/s over
the reference's measured figure; ``--json`` then holds ``rows`` of ``model``, ``config``,
``tokens_per_s``, ``ours_over_measured``.

For each model of the published 8x RTX 4090 table (same sequences per optimizer step, same
forward-backward calls, 2048-token sequences):

1. the reference's measured tokens/s and the simulator's figure for the reference's setup (as
   ``python -m benchmarks.validation.published_gpu`` simulates it);
2. a waterfall from that setup to this engine's default, one cause at a time, each row the
   tokens/s after switching that cause and its share of the whole difference
   (:func:`roundpipe_lab.analysis.own_engine.waterfall`);
3. what both designs pay in the simulation (kernel launches, the call barrier), as what the
   default would reach without each;
4. this engine's best exact setup (partition policy, microbatches, calls per optimizer step
   searched) and its best with inexact options (staleness 1, fp16 with fp16 accumulation);
5. the tokens per microbatch below which one Python process could not keep the GPUs busy.

It reads whatever hardware profiles and option defaults are present, so it can be re-run after
they change. Every tokens/s figure it prints is simulated except the "measured" column.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import cli, write_json  # noqa: E402
from roundpipe_lab.analysis.own_engine import (best_setup, host_limit_tokens, inexact_variants, our_default,
                                                 published_run, shared_costs, tasks_per_compute, waterfall)
from lightning_roundpipe.cost.transformer import get_model_shape, shape_layer_costs
from lightning_roundpipe.cost.hardware import load_hardware
from roundpipe_lab.analysis.paper import config_rows, model_rows
from roundpipe_lab.analysis.workload import PUBLISHED_RUNS


def describe(result) -> str:
    if result is None:
        return "-"
    if result.tokens_per_s <= 0:
        return f"does not fit ({result.refused})"
    s = result.setup
    return (f"{result.tokens_per_s:,.0f} ({s.partition}, {result.microbatches} microbatches x {result.calls} calls, "
            f"staleness {s.staleness}, {s.precision}, bubble {result.bubble:.0%})")


def model_report(model: str, hardware: str, best: bool = True) -> dict:
    hw = load_hardware(hardware)
    run = published_run(model)
    rows = waterfall(run, hw)
    start = rows[0].result.tokens_per_s
    fitting = [r for r in rows if r.result.tokens_per_s > 0]
    end = fitting[-1].result.tokens_per_s
    default = rows[-1].result
    report = dict(model=model, measured=run.measured_stale, reference_simulated=start, waterfall=[], default=default)
    for row in rows[1:]:
        share = row.delta / (end - start) if row.result.tokens_per_s > 0 and end != start else None
        report["waterfall"].append(dict(cause=row.cause, tokens_per_s=row.result.tokens_per_s, delta=row.delta,
                                        share=share, refused=row.result.refused))
    base = default.setup if default.tokens_per_s > 0 else fitting[-1].result.setup
    report["shared"] = [(name, r.tokens_per_s) for name, r in shared_costs(run, hw, base)]
    report["base_for_shared"] = describe(default if default.tokens_per_s > 0 else fitting[-1].result)
    if best:
        exact = best_setup(run, hw)
        same_calls = [r for r in exact if r.calls == run.stale.calls]
        report["best_exact"] = exact[0] if exact else None
        report["best_exact_same_calls"] = same_calls[0] if same_calls else None
        report["inexact"] = inexact_variants(run, hw, exact[0].setup) if exact else []
    plan_result = default if default.tokens_per_s > 0 else fitting[-1].result
    plan, m = plan_result.plan, plan_result.microbatches
    ours = our_default(hw)
    costs = shape_layer_costs(get_model_shape(model), hw, run.stale.seq_len, 1, loss_chunk_tokens=ours.loss_chunk_tokens)
    k = tasks_per_compute(plan, costs, hw.num_gpus, m)
    report["host_limit_tokens"] = host_limit_tokens(plan, costs, hw, ours.dispatch_s, k)
    report["host_limit_plan"] = plan.to_text()
    report["tokens_per_microbatch"] = run.stale.sequences_per_step * run.stale.seq_len / (m * plan_result.calls)
    return report


def to_markdown(reports: list[dict], hardware: str, header: bool = True, footer: bool = True) -> str:
    hw = load_hardware(hardware)
    ours = our_default(hw)
    lines = [f"This engine on the reference workload, {hw.num_gpus}x {hw.name} (simulated; 'measured' is the "
             f"reference's published figure)", ""] if header else []
    for rep in reports:
        lines += [f"### {rep['model']}", "",
                  "| setup / cause switched | tokens/s | change | share of the difference |", "|---|---:|---:|---:|",
                  f"| reference, measured | {rep['measured']:,} | | |",
                  f"| reference setup, simulated | {rep['reference_simulated']:,.0f} | | |"]
        for row in rep["waterfall"]:
            if row["tokens_per_s"] <= 0:
                lines.append(f"| {row['cause']} | does not fit: {row['refused']} | | |")
                continue
            share = f"{row['share']:.0%}" if row["share"] is not None else ""
            lines.append(f"| {row['cause']} | {row['tokens_per_s']:,.0f} | {row['delta']:+,.0f} | {share} |")
        lines += ["", f"Our default: {describe(rep['default'])}.", f"From {rep['base_for_shared']}:"]
        for name, tps in rep["shared"]:
            lines.append(f"- {name}: {tps:,.0f}")
        if "best_exact" in rep:
            lines += [f"- best exact setup, the reference's calls per step: {describe(rep['best_exact_same_calls'])}",
                      f"- best exact setup: {describe(rep['best_exact'])}"]
            lines += [f"- the best exact setup with {name}: {describe(r)}" for name, r in
                      zip(("staleness 1", "staleness 1 and fp16 with fp16 accumulation"), rep["inexact"])]
        lines += [f"- one host process limits below {rep['host_limit_tokens']:,.0f} tokens per microbatch "
                  f"(this run: {rep['tokens_per_microbatch']:,.0f}; plan {rep['host_limit_plan']})", ""]
    if not footer:
        return "\n".join(lines)
    lines.append(f"Per-call host work priced: dispatch {ours.dispatch_s * 1e6:.0f} us per task (cpu2 profile, measured), "
                 f"kernel launches {hw.launch_s * 1e6:.0f} us each ({hw.forward_launches_per_layer} / "
                 f"{hw.backward_launches_per_layer} per decoder layer forward / backward), gradient accumulation "
                 f"{ours.host_accumulate_bytes_per_s / 1e9:.1f} GB/s (host Adam rate x measured ratio).")
    return "\n".join(lines)


def quick_model_rows(model: str, hardware: str) -> list[dict]:
    """The ``--quick`` rows of one model (a separate process per model: see ``quick``)."""
    return config_rows(model_rows(model, hardware))


def quick(args) -> None:
    """``--quick``: the configurations of ``analysis.paper`` per model, printed and written as rows.

    The models' simulations are independent, so they run in worker processes, up to one per core
    (forked: the imports are not paid again); each model's rows print in order as they come."""
    start = time.perf_counter()
    processes = min(len(args.models), os.cpu_count() or 1)
    if processes > 1 and "fork" in multiprocessing.get_all_start_methods():
        pool = multiprocessing.get_context("fork").Pool(processes)
        results = pool.imap(functools.partial(quick_model_rows, hardware=args.hardware), args.models)
    else:
        pool = None
        results = (quick_model_rows(model, args.hardware) for model in args.models)
    rows = []
    try:
        for model, model_rows_ in zip(args.models, results):
            rows += model_rows_
            for r in model_rows_:
                ratio = f"{r['ours_over_measured']:.2f}x" if r["ours_over_measured"] is not None else "-"
                tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else "does not fit"
                print(f"{model:14} {r['config']:32} {tps:>10} {ratio:>6}  {r['setting']}", flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        write_json(args.json, dict(hardware=args.hardware, rows=rows))


def main(argv: list[str] | None = None) -> None:
    parser = cli(__doc__.splitlines()[0], json_help="also write the figures to this JSON file",
                 quick="only the configurations (reference setup, default, best exact, best exact at the reference's "
                       "precision), on the reference's partition: minutes instead of half an hour")
    parser.add_argument("--hardware", default="rtx4090")
    parser.add_argument("--models", nargs="*", default=[r.model for r in PUBLISHED_RUNS])
    parser.add_argument("--no-best", action="store_true", help="skip the search for the best setups (slow)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.quick:
        quick(args)
        return
    reports = []
    for i, model in enumerate(args.models):  # each model as soon as it is done
        reports.append(model_report(model, args.hardware, best=not args.no_best))
        print(to_markdown(reports[-1:], args.hardware, header=i == 0, footer=i == len(args.models) - 1), flush=True)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    if args.json:
        def plain(key, value):
            if key in ("default", "best_exact", "best_exact_same_calls"):
                return dict(text=describe(value), tokens_per_s=value.tokens_per_s if value is not None else None)
            if key == "inexact":
                return [dict(text=describe(r), tokens_per_s=r.tokens_per_s) for r in value]
            return value
        write_json(args.json, dict(hardware=args.hardware, models=[{k: plain(k, v) for k, v in r.items()}
                                                                   for r in reports]))


if __name__ == "__main__":
    main()
