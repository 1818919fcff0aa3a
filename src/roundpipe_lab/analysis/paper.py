"""The paper's comparison on the workload it published: a row per system, simulated beside measured.

The reference RoundPipe's published 8x RTX 4090 figures (``workload.PUBLISHED_RUNS``) are the
yardstick; per model ``paper_rows`` gives the reference measured and simulated, this engine's
defaults, its best exact setup at bf16 and at the reference's fp16 accumulation, and the
published bound baselines. Rows are dicts with ``model``, ``system``, ``simulated``,
``measured`` and a ``setting`` in words. What each row runs: docs/design.md, design notes,
``analysis/paper.py``; the results: docs/reference_workload.md and docs/simulator.md.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_roundpipe.cost.hardware import HardwareProfile, load_hardware
from .precision import loss_scaled, waits_for_every_gradient
from .own_engine import REFERENCE, Setup, SetupResult, our_default, published_run, simulate_setup
from .workload import PUBLISHED_RUNS

REFERENCE_SIMULATED = "reference (simulated)"
# The simulated systems by the config names of ``benchmarks.figures.own_engine_reference --quick``.
CONFIGS = {REFERENCE_SIMULATED: "reference_setup", "ours: defaults": "default", "ours: best exact": "best_exact",
           "ours: best exact, reference precision": "best_exact_reference_precision"}
# The paper's bound baselines on 8x RTX 4090, tokens/s (exp/raw-data.csv of
# github.com/ITcarrot/RoundPipe-artifact; None: out of memory).
PUBLISHED_BASELINES = {
    "Megatron-PP (measured)": {"qwen3-1.7b": 39_081, "llama-3.1-8b": 16_412, "qwen3-32b": None},
    "Mobius (measured)": {"qwen3-1.7b": 39_370, "llama-3.1-8b": 11_288, "qwen3-32b": 2_552},
}
PUBLISHED_SEQ_LEN = 2048


PLANNED_PARTITION = "auto"  # the planner's own partition, searched on the simulated (measured) costs


def exact_candidates(hardware: HardwareProfile, calls: int, precision: str = "bf16-mixed",
                     early_stop: bool = True) -> list[Setup]:
    """The exact setups a user can set that the quick search tries, beside the defaults: compiled
    layers with the early-stopping recompute (``recompute_early_stop``; ``early_stop`` False: without it), the
    step's sequences in one call of ``10 x calls`` microbatches (the reference's sequences per microbatch) or ``30 x
    calls`` (a third of them: shorter fill and drain), on the reference's partition, and on the planner's own
    partition (``PLANNED_PARTITION``; a plan search each, the slow part of ``sim paper``) the ``30 x calls`` count
    in one call and 30 microbatches in each of the workload's ``calls`` (the user's own accumulation, kept; the
    calls that only accumulate overlap, ``overlap_calls``). One call means one pipeline drain per optimizer step
    instead of one per call (the next call waits for ``backward()``). With fp16 layers step early under the host
    loss scaler as without it, the failed-step undo putting them back on overflow; only without the undo does the
    optimizer wait for every gradient (``precision.waits_for_every_gradient``); each layer's update then unscales
    its gradient first (``host_unscale``)."""
    default = our_default(hardware)
    base = replace(default, partition=REFERENCE, compiled_layers=True, early_stop=early_stop, precision=precision,
                   wait_all_grads=waits_for_every_gradient(precision, default.undo), host_unscale=loss_scaled(precision))
    one_call = [replace(base, microbatches=k * calls, calls=1) for k in (10, 30)]
    planned = [replace(one_call[-1], partition=PLANNED_PARTITION), replace(base, microbatches=30, calls=calls,
                                                                          partition=PLANNED_PARTITION)]
    return one_call + planned


def best_of(results: list[SetupResult]) -> SetupResult:
    """The fastest fitting result (the first when none fits)."""
    fitting = [r for r in results if r.tokens_per_s > 0]
    return max(fitting, key=lambda r: r.tokens_per_s) if fitting else results[0]


def describe_setup(result: SetupResult) -> str:
    """A setup's result in words: microbatches x calls, precision, staleness, compiled layers."""
    if result.tokens_per_s <= 0:
        return f"does not fit ({result.refused})"
    s = result.setup
    return (f"{result.microbatches} microbatches x {result.calls} calls, {s.precision}, staleness {s.staleness}"
            + (", compiled layers" if s.compiled_layers else "") + (", early-stopping recompute" if s.early_stop else "")
            + f", {s.partition} partition")


def model_rows(model: str, hardware: str | HardwareProfile = "rtx4090", seq_len: int = PUBLISHED_SEQ_LEN,
               optimizer_steps: int = 2) -> list[dict]:
    """The comparison's rows of one published model (see the module doc)."""
    hw = load_hardware(hardware)
    run = published_run(model)
    measured = run.measured_stale if seq_len == PUBLISHED_SEQ_LEN else None

    def simulate(setup: Setup) -> SetupResult:
        return simulate_setup(run, hw, setup, optimizer_steps=optimizer_steps, seq_len=seq_len)

    def row(system: str, result: SetupResult | None, measured_value, setting: str) -> dict:
        simulated = result.tokens_per_s if result is not None and result.tokens_per_s > 0 else None
        return dict(model=model, system=system, simulated=simulated, measured=measured_value, setting=setting)

    reference = simulate(Setup(partition=REFERENCE))
    default = simulate(our_default(hw))
    best = best_of([default] + [simulate(s) for s in exact_candidates(hw, run.stale.calls)])
    best_fp16 = best_of([simulate(s) for s in exact_candidates(hw, run.stale.calls, "fp16-acc")])
    rows = [row("reference (measured)", None, measured, "published"),
            row(REFERENCE_SIMULATED, reference, measured, describe_setup(reference)),
            row("ours: defaults", default, None, describe_setup(default)),
            row("ours: best exact", best, None, describe_setup(best)),
            row("ours: best exact, reference precision", best_fp16, None, describe_setup(best_fp16))]
    for system, figures in PUBLISHED_BASELINES.items():
        value = figures.get(model) if seq_len == PUBLISHED_SEQ_LEN else None
        rows.append(row(system, None, value, "published" if value is not None else "out of memory / not published"))
    return rows


def paper_rows(hardware: str | HardwareProfile = "rtx4090", models: tuple[str, ...] | None = None,
               seq_len: int = PUBLISHED_SEQ_LEN, optimizer_steps: int = 2) -> list[dict]:
    """``model_rows`` of each published model (default: all of ``PUBLISHED_RUNS``)."""
    names = models or tuple(r.model for r in PUBLISHED_RUNS)
    return [r for name in names for r in model_rows(name, hardware, seq_len, optimizer_steps)]


def paper_markdown(rows: list[dict], hardware: str | HardwareProfile = "rtx4090",
                   seq_len: int = PUBLISHED_SEQ_LEN) -> str:
    """The rows as a markdown table, with each simulated row over the reference's measured figure."""
    from lightning_roundpipe.cost.text_table import render_table

    hw = load_hardware(hardware)
    measured = {r["model"]: r["measured"] for r in rows if r["system"] == REFERENCE_SIMULATED}

    def number(value) -> str:
        return f"{value:,.0f}" if value is not None else "-"

    table = []
    for r in rows:
        ref = measured.get(r["model"])
        value = r["simulated"] if r["simulated"] is not None else r["measured"]
        ratio = f"{value / ref:.2f}x" if value is not None and ref else "-"
        table.append((r["model"], r["system"], number(r["simulated"]), number(r["measured"]), ratio, r["setting"]))
    lines = [f"The reference's published workload on {hw.num_gpus}x {hw.name}: {seq_len}-token sequences, the "
             f"published sequences per optimizer step and calls, full fine-tuning, fp32 Adam on the host.", "",
             render_table(("model", "system", "simulated tokens/s", "measured tokens/s", "over the reference's measured",
                           "setting"), table, right=(2, 3, 4), markdown=True), "",
             "Simulated rows: the simulator with the assumptions in docs/simulator.md (hardware numbers from "
             f"src/lightning_roundpipe/cost/profiles/{hw.name}.yaml), each row on the partition its setting names; "
             "measured rows: the reference artifact's published figures."]
    return "\n".join(lines)


def config_rows(rows: list[dict]) -> list[dict]:
    """The simulated rows of ``paper_rows`` as ``model``, ``config`` (``CONFIGS``), ``tokens_per_s``
    and ``ours_over_measured`` (over the reference's published figure; None without one)."""
    measured = {r["model"]: r["measured"] for r in rows if r["system"] == REFERENCE_SIMULATED}
    out = []
    for r in rows:
        if r["system"] in CONFIGS:
            ref, tps = measured.get(r["model"]), r["simulated"]
            out.append(dict(model=r["model"], config=CONFIGS[r["system"]], tokens_per_s=tps,
                            ours_over_measured=tps / ref if tps is not None and ref else None, setting=r["setting"]))
    return out
