"""Every task's failure fails the step: in the lowered graph it reaches what the host waits for.

A worker task whose dependency failed fails too (``Lane._pick``), so a failure travels along the
graph's dependencies. The host waits only for what it brings home: the last layer's outputs,
the fused stage's losses, the weight gradients and the caller's input gradients (``StepRun``).
A failure that reaches none of them is lost: the step goes on without that microbatch's work.
Releases of a stage's memory are the exception: they run even after a failure (so a failed step
frees what it held), drop references only, and nothing reads what they produce.

The lowering property is checked over many plans, microbatch and worker counts and options; the
engine test makes each task of real graphs fail in turn and checks that the call raises.
"""

import dataclasses
import itertools

import pytest
import torch
from torch import nn

from lightning_roundpipe import CpuWorkerPool, EngineOptions, PipelineEngine, WorkerError
from lightning_roundpipe.schedule.lowering import LoweringOptions, TaskGraph, lower
from lightning_roundpipe.planning.cuts import simple_plan
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.workers.pool import Worker

from _models import LossHead, mlp

RUN_EVEN_AFTER_A_FAILURE = ("release", "free_kept")  # they free memory; see the module doc


def host_waited(graph: TaskGraph) -> set[int]:
    """Ids of the tasks the engine's host thread waits for (engine/step.py: forward, fused_loss, backward)."""
    last_layer = max(t.end for t in graph)
    return {t.id for t in graph if t.kind in ("loss", "wgrad") or (t.kind == "act_out" and t.boundary == last_layer)
            or (t.kind == "grad_out" and t.boundary == 0)}


def lost_failures(graph: TaskGraph) -> list[str]:
    """The tasks whose failure reaches no host wait through the graph's dependencies."""
    waited = host_waited(graph)
    reaches = [False] * len(graph)
    for t in reversed(graph.tasks):  # dependants come after their dependencies (validate() checks it)
        reaches[t.id] = reaches[t.id] or t.id in waited
        if reaches[t.id] and t.kind not in RUN_EVEN_AFTER_A_FAILURE:
            for d in t.deps:
                reaches[d] = True
    return [t.to_text() for t in graph if not reaches[t.id] and t.kind not in RUN_EVEN_AFTER_A_FAILURE]


class FlatSizes:
    def __init__(self, chunks=1):
        self.chunks = chunks

    def weight_chunks(self, start, end):
        return [(start, end, 100) for _ in range(self.chunks)]

    def grad_chunks(self, start, end):
        return [(start, end, 100 * (end - start))]

    def boundary_bytes(self, boundary):
        return 10


def all_cuts(n):
    """Every way to cut ``n`` layers into contiguous stages."""
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = (0, *cuts, n)
            yield tuple(zip(bounds[:-1], bounds[1:]))


def plans():
    """Every plan of up to 3 layers (any cuts in each direction, fused where it can be), and the
    default-shaped plans of 7 layers over 1 to 4 workers."""
    for n in (1, 2, 3):
        for fwd in all_cuts(n):
            for bwd in all_cuts(n):
                yield Plan(n, fwd, bwd).validate()
                if fwd[-1] == bwd[-1]:
                    yield Plan(n, fwd, bwd, fused_last=True).validate()
    for workers, same_cuts, fused in itertools.product((1, 2, 3, 4), (True, False), (True, False)):
        yield simple_plan(7, workers, same_cuts=same_cuts, fused_last=fused)


OPTIONS = [dict(training=False), dict(), dict(fused=True), dict(input_gradient=True),
           dict(fused=True, input_gradient=True), dict(layer_recompute=True, fused=True),
           dict(recompute=False), dict(recompute=False, kept_backward=False), dict(recompute=False, fused=True),
           dict(prefetch_depth=2)]
ENGINE_FIELDS = {"recompute", "layer_recompute", "prefetch_depth"}  # the rest are the call's kind


def lowering_options(microbatches: int, options: dict) -> LoweringOptions:
    """``options`` split between the engine's options and the call's kind."""
    engine = {k: v for k, v in options.items() if k in ENGINE_FIELDS}
    call = {k: v for k, v in options.items() if k not in ENGINE_FIELDS}
    return LoweringOptions(EngineOptions(microbatches=microbatches, **engine), **call)


@pytest.mark.timeout(120)  # pure lowering, no threads: 8-25 s alone, 30 s was hit at load average 10
def test_every_task_failure_reaches_a_host_wait_in_every_lowered_graph():
    graphs = 0
    for plan in plans():
        for m, workers, options in itertools.product((1, 2, 3, 4, 5), (1, 2, 3), OPTIONS):
            if "recompute" in options and not plan.same_cuts():
                continue
            graph = lower(plan, workers, m % workers, FlatSizes(chunks=1 + m % 2), lowering_options(m, options))
            lost = lost_failures(graph)
            assert not lost, f"{plan.to_text()}, {m} microbatches, {workers} workers, {options}:\n" + "\n".join(lost)
            graphs += 1
    assert graphs > 4000  # the range above was really covered


def test_a_failure_on_a_non_last_microbatch_reached_no_host_wait_when_gradients_waited_on_the_last_only():
    """What the property catches: the rule the lowering had (gradients after the last compute) loses
    microbatch 0 of stage B0 (layer 0 sends no input gradient home, so its computes feed nothing else)."""
    graph = lower(Plan.from_text("F 0:2 | B 0:1 1:2"), 2, 0, FlatSizes(), LoweringOptions(EngineOptions(microbatches=2)))
    computes = {t.stage: [c.id for c in graph if c.stage == t.stage and c.lane == "compute"]
                for t in graph if t.kind == "wgrad"}
    assert [t.deps for t in graph if t.kind == "wgrad"] == [tuple(computes["B1"]), tuple(computes["B0"])]
    last_only = TaskGraph(tuple(dataclasses.replace(t, deps=t.deps[-1:]) if t.kind == "wgrad" else t for t in graph),
                          graph.num_workers, graph.next_worker, graph.next_serial)
    lost = [tuple(line.split()[3:6]) for line in lost_failures(last_only)]
    assert lost == [("act_save", "F0[0:2]", "mb0"), ("act_in", "B1[1:2]", "mb0"), ("grad_in", "B1[1:2]", "mb0"),
                    ("backward", "B1[1:2]", "mb0"), ("grad_out", "B1[1:2]", "mb0"), ("act_in", "B0[0:1]", "mb0"),
                    ("grad_in", "B0[0:1]", "mb0"), ("backward", "B0[0:1]", "mb0")]


class Injected(RuntimeError):
    pass


ENGINE_CASES = [(2, True, False, False), (2, True, True, False), (3, False, False, False), (2, True, False, True),
                (1, True, True, False)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers,recompute,fused,input_grad", ENGINE_CASES)
def test_the_engine_raises_whichever_task_fails(workers, recompute, fused, input_grad, monkeypatch):
    """Each task of a real step made to fail in turn (releases aside): the call raises its error."""
    n, m = 5, 3
    layers = mlp(depth=n - 1, width=4) + [LossHead(4) if fused else nn.Linear(4, 4)]
    plan = Plan.from_text("F 0:3 3:5 | B 0:1 1:3 3:5" + (" | fused" if fused else ""), n) if recompute else \
        Plan.from_text("F 0:2 2:5 | B 0:2 2:5" + (" | fused" if fused else ""), n)
    # The engine submits the graph's tasks in graph order (test_lowering.py), so the n-th task a
    # step submits is graph task n.
    target = {"id": None, "submitted": 0}
    submit = Worker.submit

    def failing_submit(worker, queue, fn, deps, label, priority=0, nbytes=0, always=False):
        tid, target["submitted"] = target["submitted"], target["submitted"] + 1
        if tid == target["id"]:
            def fn(tid=tid, kind=label.kind):
                raise Injected(f"injected failure of task {tid} ({kind})")
        return submit(worker, queue, fn, deps, label, priority, nbytes, always)

    monkeypatch.setattr(Worker, "submit", failing_submit)
    pool = CpuWorkerPool(workers, timeout_s=20)
    eng = PipelineEngine(layers, pool, plan, EngineOptions(microbatches=m, recompute=recompute))
    g = torch.Generator().manual_seed(0)

    def step():
        target["submitted"] = 0
        x = torch.randn(6, 4, generator=g).requires_grad_(input_grad)
        if fused:
            loss = eng(x, loss_scale=0.5)
        else:
            loss = eng(x).pow(2).sum()
        loss.backward()

    try:
        step()  # a clean step: the graph of every later step has the same ids
        graph = eng.last_run.graph
        checked = 0
        for t in graph:
            if t.kind in RUN_EVEN_AFTER_A_FAILURE:
                continue
            target["id"] = t.id
            with pytest.raises(WorkerError, match=f"injected failure of task {t.id} ") as info:
                step()
            assert isinstance(info.value.original, Injected)
            checked += 1
        assert checked == sum(t.kind not in RUN_EVEN_AFTER_A_FAILURE for t in graph) > 20
        target["id"] = None
        step()  # and the engine still runs a clean step after them
    finally:
        eng.close()
