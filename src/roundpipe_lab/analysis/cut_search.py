"""A local search of a setup's stage cuts with every candidate plan simulated whole (an analysis tool).

The planner's one-call timing model does not see which worker gets which stages over a step of
several calls; this search simulates instead, moving, removing or adding one cut at a time while
the step gets faster by more than ``MIN_GAIN``: a local optimum, 1-3 s per simulation. The plan it
finds can be set with ``partition.policy="manual"``. Details: docs/design.md, design notes,
``analysis/cut_search.py``.

    python -m roundpipe_lab.analysis.cut_search MODEL --microbatches M --calls C [--start POLICY] [--budget S]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

from lightning_roundpipe.cost.hardware import HardwareProfile, load_hardware
from lightning_roundpipe.schedule.plan import Plan, PlanError
from .own_engine import PublishedRun, Setup, SetupResult, simulate_setup

MIN_GAIN = 5e-4  # a move must simulate this share faster to be taken (the simulator is deterministic)

Cuts = tuple[tuple[int, ...], tuple[int, ...]]  # (forward cuts, backward cuts below the fused stage)


@dataclass
class CutSearch:
    """The result: the starting and the best result, the plans simulated and the seconds spent."""

    start: SetupResult
    best: SetupResult
    evaluated: int
    seconds: float


def cuts_of(plan: Plan) -> Cuts:
    """A fused-last plan's interior cuts: forward (the last is where the fused stage starts) and backward."""
    return tuple(a for a, _ in plan.forward[1:]), tuple(a for a, _ in plan.backward[1:-1])


def plan_of(num_layers: int, cuts: Cuts) -> Plan:
    """The fused-last plan of ``cuts`` (raises ``PlanError`` or ``ValueError`` when they do not make one)."""
    forward_cuts, backward_cuts = cuts
    if not forward_cuts or any(c >= forward_cuts[-1] for c in backward_cuts):
        raise PlanError("a backward cut at or above the fused stage")
    head = forward_cuts[-1]
    forward = tuple(zip((0,) + forward_cuts, forward_cuts + (num_layers,)))
    backward = tuple(zip((0,) + backward_cuts, backward_cuts + (head,))) + ((head, num_layers),)
    return Plan(num_layers, forward, backward, fused_last=True).validate()


def moves(cuts: Cuts, num_layers: int) -> list[Cuts]:
    """Every plan one move away: a cut shifted by one layer, removed or added, in either direction (the fused
    stage's start is shifted only)."""
    forward_cuts, backward_cuts = cuts
    head = forward_cuts[-1]
    out: list[Cuts] = []

    def shifted(cs: tuple[int, ...], top: int, fixed_last: bool) -> list[tuple[int, ...]]:
        found = []
        for i in range(len(cs)):
            for d in (-1, 1):
                c = list(cs)
                c[i] += d
                if 1 <= c[i] < top and len(set(c)) == len(c):
                    found.append(tuple(sorted(c)))
            if not (fixed_last and i == len(cs) - 1):
                found.append(cs[:i] + cs[i + 1:])  # two stages merged
        found += [tuple(sorted(cs + (x,))) for x in range(1, top) if x not in cs]  # a stage split
        return found

    out += [(f, backward_cuts) for f in shifted(forward_cuts, num_layers, fixed_last=True)]
    out += [(forward_cuts, b) for b in shifted(backward_cuts, head, fixed_last=False)]
    return out


def search_cuts(run: PublishedRun, hardware: str | HardwareProfile, setup: Setup, *, budget_s: float = 600.0,
                optimizer_steps: int = 2, start_plan: Plan | None = None) -> CutSearch:
    """Greedy first-improvement search from ``start_plan`` or else ``setup``'s plan (``setup.partition`` gives
    it); the plan must have a fused last stage. Each plan is simulated by ``simulate_setup(plan=...)``; the search
    stops at a local optimum or after ``budget_s`` seconds."""
    hw = load_hardware(hardware)
    started = time.perf_counter()
    start = simulate_setup(run, hw, setup, optimizer_steps=optimizer_steps, plan=start_plan)
    if start.plan is None or not start.plan.fused_last:
        raise ValueError(f"the search starts from a plan with a fused last stage; {setup.partition!r} gave "
                         f"{'none' if start.plan is None else 'one without'}")
    n = start.plan.num_layers
    best, cuts = start, cuts_of(start.plan)
    seen = {cuts}
    improved = True
    while improved and time.perf_counter() - started < budget_s:
        improved = False
        for candidate in moves(cuts, n):
            if candidate in seen:
                continue
            seen.add(candidate)
            try:
                plan = plan_of(n, candidate)
            except (PlanError, ValueError):
                continue
            result = simulate_setup(run, hw, replace(setup, partition="manual"), optimizer_steps=optimizer_steps,
                                    plan=plan)
            if result.tokens_per_s > best.tokens_per_s * (1 + MIN_GAIN):
                best, cuts, improved = result, candidate, True
                break
            if time.perf_counter() - started >= budget_s:
                break
    return CutSearch(start, best, len(seen), time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    """Search the best exact setup's cuts for one published model at bf16-mixed and print the result."""
    from .exact_gap import reference_at_bf16
    from .own_engine import published_run
    from .paper import exact_candidates

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--calls", type=int, required=True)
    parser.add_argument("--start", default="auto", help="the partition policy of the starting plan")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds")
    parser.add_argument("--hardware", default="rtx4090")
    args = parser.parse_args(argv)
    hw = load_hardware(args.hardware)
    run = published_run(args.model)
    setup = replace(exact_candidates(hw, run.stale.calls)[-1], microbatches=args.microbatches, calls=args.calls,
                    partition=args.start)
    reference = reference_at_bf16(run, hw, 2)
    found = search_cuts(run, hw, setup, budget_s=args.budget)
    for label, r in (("start", found.start), ("found", found.best)):
        print(f"{label}: {r.tokens_per_s:,.0f} tokens/s, {r.tokens_per_s / reference.tokens_per_s:.3f}x the reference's "
              f"setup at bf16 ({reference.tokens_per_s:,.0f})")
    print(f"{found.evaluated} plans, {found.seconds:.0f} s")
    print(f"manual_forward: {[list(r) for r in found.best.plan.forward]}")
    print(f"manual_backward: {[list(r) for r in found.best.plan.backward]}")


if __name__ == "__main__":
    main()
