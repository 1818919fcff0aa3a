"""Where the exact optimizer's time goes against the one-step-stale one, read off the simulated timeline.

``exact_gap`` splits the time the next step starts later under the exact optimizer into drain,
gradient home, host queue, first layer update and upload; ``step_breakdown`` splits one step's
period per worker into compute, fill, drain, idle and the boundary; ``bound`` gives the most an
exact setup can reach against the reference's. Why these terms: docs/design.md, design notes,
``analysis/exact_gap.py``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from lightning_roundpipe.cost.hardware import HardwareProfile, load_hardware
from lightning_roundpipe.cost.physical import layer_seconds
from lightning_roundpipe.cost.profile import CostProfile
from lightning_roundpipe.cost.transformer import ModelShape, down_projection_work, get_model_shape, shape_layer_costs
from .own_engine import PublishedRun, Setup, SetupResult, simulate_setup

CAUSES = ("drain", "gradient home", "host queue", "first layer update", "upload and start")
PARTS = ("compute", "fill", "drain", "idle inside", "boundary")  # step_breakdown's, adding up to the period


def step_breakdown(result: SetupResult, optimizer_step: int = 0) -> dict:
    """Seconds of optimizer step ``optimizer_step`` of a simulated setup (it needs the step after it),
    per worker averaged over the workers: ``PARTS``, which add up to ``period``, and ``max_compute``
    (the busiest worker's), with the boundary's causes at a call barrier: ``gradient home`` (the
    step's last compute to its last weight gradient home), ``first layer update`` (layer 0's update
    ending after that) and ``upload and start`` (the rest)."""
    calls, tl = result.calls, result.call.timeline
    steps = range(optimizer_step * calls, (optimizer_step + 1) * calls)
    compute = [r for r in tl if r.queue == "compute" and r.step in steps]
    workers = sorted({r.worker for r in tl if r.queue == "compute"})
    first = min(r.start for r in compute)
    last = max(r.end for r in compute)
    following = min(r.start for r in tl if r.queue == "compute" and r.step == steps[-1] + 1)
    busy = {w: sum(r.end - r.start for r in compute if r.worker == w) for w in workers}
    starts = {w: min((r.start for r in compute if r.worker == w), default=last) for w in workers}
    ends = {w: max((r.end for r in compute if r.worker == w), default=last) for w in workers}
    n = len(workers)
    parts = {"compute": sum(busy.values()) / n,
             "fill": sum(starts[w] - first for w in workers) / n,
             "drain": sum(last - ends[w] for w in workers) / n,
             "idle inside": sum(ends[w] - starts[w] - busy[w] for w in workers) / n,
             "boundary": following - last}
    home = max((r.end for r in tl if r.kind == "wgrad" and r.step == steps[-1]), default=last)
    update = next((r.end for r in tl if r.kind == "optim" and r.step == steps[-1] and r.stage == "L0"), home)
    boundary = {"gradient home": max(0.0, home - last), "first layer update": max(0.0, update - max(home, last)),
                "upload and start": following - max(update, home, last)}
    return dict(period=following - first, parts=parts, max_compute=max(busy.values()), boundary=boundary)


def bound(reference: SetupResult, ours: SetupResult, tokens_per_step: float, target: float = 1.1) -> dict:
    """The bound of ``ours`` (an exact setup) against ``reference`` (see the module doc): seconds
    ``reference_period`` (``tokens_per_step`` over its tokens/s), ``compute`` (per worker, averaged)
    and ``boundary`` of ``ours``'s first optimizer step, ``bound_ratio``, the ratio ``ours`` reaches
    (``ratio``), and ``slack_at``: the seconds of fill, drain, idle and boundary per step left at
    ``target`` times the reference's tokens/s (negative: the compute alone is too much)."""
    parts = step_breakdown(ours)["parts"]
    period = tokens_per_step / reference.tokens_per_s
    compute, boundary = parts["compute"], parts["boundary"]
    return dict(reference_period=period, compute=compute, boundary=boundary,
                bound_ratio=period / (compute + boundary), ratio=ours.tokens_per_s / reference.tokens_per_s,
                slack_at=period / target - compute)


def bound_row(model: str, hardware: str | HardwareProfile = "rtx4090", optimizer_steps: int = 2) -> dict:
    """``bound`` of the best of ``paper.exact_candidates`` (bf16-mixed; what ``sim paper``'s best exact
    row searches beside the defaults) against the reference's setup at bf16-mixed, for one published model."""
    from .own_engine import published_run

    hw = load_hardware(hardware)
    run = published_run(model)
    reference = reference_at_bf16(run, hw, optimizer_steps)
    best = best_exact(run, hw, optimizer_steps)
    tokens = run.stale.sequences_per_step * run.stale.seq_len
    return dict(model=model, reference_tokens_per_s=reference.tokens_per_s, tokens_per_s=best.tokens_per_s,
                **bound(reference, best, tokens))


def reference_at_bf16(run: PublishedRun, hardware: HardwareProfile, optimizer_steps: int) -> SetupResult:
    """The reference's setup (its partition, one step stale) at bf16-mixed, simulated: what the 1.1x target at
    bf16 divides by."""
    from .own_engine import REFERENCE

    return simulate_setup(run, hardware, Setup(partition=REFERENCE, precision="bf16-mixed"),
                          optimizer_steps=optimizer_steps)


def best_exact(run: PublishedRun, hardware: HardwareProfile, optimizer_steps: int,
               adjust_costs: Callable[[CostProfile], CostProfile] | None = None, early_stop: bool = True) -> SetupResult:
    """The fastest of ``paper.exact_candidates`` at bf16-mixed (``sim paper``'s best exact row searches them
    beside the defaults; ``early_stop`` False: without the early-stopping recompute), each simulated with
    ``adjust_costs`` (``simulate_setup``)."""
    from .paper import best_of, exact_candidates

    return best_of([simulate_setup(run, hardware, s, optimizer_steps=optimizer_steps, adjust_costs=adjust_costs)
                    for s in exact_candidates(hardware, run.stale.calls, early_stop=early_stop)])


def down_projection_seconds(shape: ModelShape, tokens: int, hardware: HardwareProfile,
                            fp16_accumulation: bool = False) -> float:
    """Seconds of one decoder layer's MLP down projection forward over ``tokens`` tokens: ``2 x hidden
    x mlp width`` FLOPs per token (MoE: the routed experts' widths), at the profile's matmul rate."""
    return layer_seconds(down_projection_work(shape), tokens, hardware, fp16_accumulation)


def early_stop_costs(shape: ModelShape, hardware: HardwareProfile, fp16_accumulation: bool = False):
    """A what-if for ``simulate_setup(adjust_costs=...)``, the upper bound of the early-stopping recompute:
    **every** decoder layer's recompute skips its MLP down projection, as if each were the last of its backward
    stage (``recompute_early_stop`` skips it on the last layer of each stage only, ``LayerCost.early_stop_s``).
    Applied to setups without the engine's early stop (it would count twice). The transfers of every layer's
    input that one-layer backward stages need are not priced here."""

    def adjust(costs: CostProfile) -> CostProfile:
        down = down_projection_seconds(shape, costs.tokens_per_microbatch, hardware, fp16_accumulation)
        layers = list(costs.layers)
        for n in range(1, 1 + shape.num_layers):  # the decoder layers: after the embedding, before the head
            layers[n] = replace(layers[n], recompute_s=max(0.0, layers[n].recompute_s - down))
        return replace(costs, layers=layers)

    return adjust


def early_stop_row(model: str, hardware: str | HardwareProfile = "rtx4090", optimizer_steps: int = 2) -> dict:
    """The best of ``paper.exact_candidates`` (bf16-mixed) against the reference's setup at bf16-mixed: without
    the early-stopping recompute (``tokens_per_s``, ``ratio``), with it as the engine runs it
    (``early_stop_tokens_per_s``, ``early_stop_ratio``: the last layer of each backward stage), and with every
    layer stopping early (``every_layer_tokens_per_s``, ``every_layer_ratio``: ``early_stop_costs``, the what-if
    bound); ``reference_tokens_per_s``; ``down_share``: the down projection's share of a decoder layer's forward."""
    from .own_engine import published_run

    hw = load_hardware(hardware)
    run = published_run(model)
    shape = get_model_shape(model)
    reference = reference_at_bf16(run, hw, optimizer_steps)
    best = best_exact(run, hw, optimizer_steps, early_stop=False)
    stopped = best_exact(run, hw, optimizer_steps)
    every = best_exact(run, hw, optimizer_steps, adjust_costs=early_stop_costs(shape, hw), early_stop=False)
    sequences = run.stale.sequences_per_step / (best.calls * best.microbatches)  # per microbatch
    costs = shape_layer_costs(shape, hw, run.stale.seq_len, sequences, compiled_layers=best.setup.compiled_layers)
    return dict(model=model, reference_tokens_per_s=reference.tokens_per_s, tokens_per_s=best.tokens_per_s,
                ratio=best.tokens_per_s / reference.tokens_per_s, early_stop_tokens_per_s=stopped.tokens_per_s,
                early_stop_ratio=stopped.tokens_per_s / reference.tokens_per_s,
                every_layer_tokens_per_s=every.tokens_per_s, every_layer_ratio=every.tokens_per_s / reference.tokens_per_s,
                down_share=down_projection_seconds(shape, costs.tokens_per_microbatch, hw) / costs.layers[1].forward_s)


def exact_gap(run: PublishedRun, hardware: str | HardwareProfile, setup: Setup, *,
              optimizer_steps: int = 2) -> dict:
    """The causes of the exact-versus-stale difference at the first optimizer-step boundary (see
    the module doc), with both setups' tokens/s and the period difference."""
    hw = load_hardware(hardware)
    stale = simulate_setup(run, hw, replace(setup, staleness=1), optimizer_steps=optimizer_steps)
    exact = simulate_setup(run, hw, replace(setup, staleness=0), optimizer_steps=optimizer_steps)
    last = exact.calls - 1  # the last call of the first optimizer step

    def first_compute(result, call):
        return min(r.start for r in result.call.timeline if r.queue == "compute" and r.step == call)

    tl = exact.call.timeline
    drained = max(r.end for r in tl if r.queue == "compute" and r.step == last)
    home = max(r.end for r in tl if r.kind == "wgrad" and r.step == last)  # layer 0's is the last one home
    update = next(r for r in tl if r.kind == "optim" and r.step == last and r.stage == "L0")
    marks = [first_compute(stale, last + 1), drained, home, update.start, update.end, first_compute(exact, last + 1)]
    causes = {name: b - a for name, a, b in zip(CAUSES, marks, marks[1:])}
    period = {name: run.stale.sequences_per_step * run.stale.seq_len / r.tokens_per_s for name, r in
              (("stale", stale), ("exact", exact))}
    return dict(model=run.model, stale_tokens_per_s=stale.tokens_per_s, exact_tokens_per_s=exact.tokens_per_s,
                period_difference_s=period["exact"] - period["stale"], causes=causes)


def breakdown_rows(model: str, hardware: str | HardwareProfile = "rtx4090", optimizer_steps: int = 2) -> list[dict]:
    """``step_breakdown`` of the setups ``docs/simulator.md`` compares for one published model: the
    reference's setup at bf16-mixed, the best exact candidates on the reference's partition (exact
    and one step stale) and on the planner's (``paper.exact_candidates``: 30 x calls microbatches in one call,
    and 30 in each of the workload's calls)."""
    from .own_engine import REFERENCE, published_run
    from .paper import exact_candidates

    hw = load_hardware(hardware)
    run = published_run(model)
    _, reference_partition, planned, planned_calls = exact_candidates(hw, run.stale.calls)
    setups = {"reference setup at bf16": Setup(partition=REFERENCE, precision="bf16-mixed"),
              "best exact, reference partition": reference_partition,
              "the same, one step stale": replace(reference_partition, staleness=1),
              "best exact, planner's partition": planned,
              "the same, the workload's calls": planned_calls}
    rows = []
    for name, setup in setups.items():
        result = simulate_setup(run, hw, setup, optimizer_steps=optimizer_steps)
        rows.append(dict(model=model, setup=name, tokens_per_s=result.tokens_per_s, **step_breakdown(result)))
    return rows


def main(models: list[str] | None = None, bounds: bool = False, early_stop: bool = False) -> None:
    """Print ``breakdown_rows`` of every published model (or of ``models``) as a markdown table;
    with ``bounds``, ``bound_row`` of each instead; with ``early_stop``, ``early_stop_row``."""
    from lightning_roundpipe.cost.text_table import render_table
    from .workload import PUBLISHED_RUNS

    table = []
    names = models or [r.model for r in PUBLISHED_RUNS]
    if early_stop:
        for model in names:
            r = early_stop_row(model)
            table.append((model, f"{r['down_share']:.1%}", f"{r['reference_tokens_per_s']:,.0f}",
                          f"{r['tokens_per_s']:,.0f}", f"{r['ratio']:.3f}x", f"{r['early_stop_tokens_per_s']:,.0f}",
                          f"{r['early_stop_ratio']:.3f}x", f"{r['every_layer_tokens_per_s']:,.0f}",
                          f"{r['every_layer_ratio']:.3f}x"))
        print(render_table(("model", "down projection / layer forward", "reference at bf16, tokens/s",
                            "best exact without early stop, tokens/s", "ratio", "with recompute_early_stop, tokens/s",
                            "ratio", "every layer stopping early (what-if), tokens/s", "ratio"), table,
                           right=tuple(range(1, 9)), markdown=True))
        return
    if bounds:
        for model in names:
            r = bound_row(model)
            table.append((model, f"{r['reference_tokens_per_s']:,.0f}", f"{r['reference_period']:.2f}",
                          f"{r['tokens_per_s']:,.0f}", f"{r['ratio']:.3f}x", f"{r['compute']:.2f}",
                          f"{r['boundary']:.2f}", f"{r['bound_ratio']:.3f}x", f"{r['slack_at']:.2f}"))
        print(render_table(("model", "reference at bf16, tokens/s", "its period", "best exact, tokens/s", "ratio",
                            "compute per worker", "boundary", "bound", "slack at 1.1x"), table,
                           right=tuple(range(1, 9)), markdown=True))
        return
    for model in names:
        for r in breakdown_rows(model):
            table.append((r["model"], r["setup"], f"{r['tokens_per_s']:,.0f}",
                          *(f"{r['parts'][p]:.2f}" for p in PARTS), f"{r['max_compute']:.2f}"))
    print(render_table(("model", "setup", "tokens/s", *PARTS, "busiest worker"), table,
                       right=tuple(range(2, 4 + len(PARTS))), markdown=True))


if __name__ == "__main__":
    import sys

    flags = ("--bound", "--early-stop")
    names = [a for a in sys.argv[1:] if a not in flags]
    main(names or None, bounds="--bound" in sys.argv[1:], early_stop="--early-stop" in sys.argv[1:])
