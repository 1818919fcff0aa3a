"""The engine lowers a kind of call once (``StepContext.lower`` through ``schedule/history.py``).

Each call's graph must be exactly what ``lower`` gives for that call's start worker and first
serial, and a change that decides the graph (a layer frozen between steps, another microbatch
count) must give a newly lowered graph, never a stale one.
"""

import pytest
import torch

from lightning_roundpipe import EngineOptions, PipelineEngine, Plan
from lightning_roundpipe.engine.step import TableSizes
from lightning_roundpipe.schedule.lowering import LoweringOptions, lower
from lightning_roundpipe.workers import make_pool

from _models import mlp

PLAN = Plan(4, [(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 4)])


def _fresh(ctx, microbatches, first_worker, first_serial):
    o = ctx.options
    return lower(ctx.plan, len(ctx.pool), first_worker, TableSizes(ctx.tables, o.compute_dtype, o.chunk_bytes),
                 LoweringOptions(EngineOptions(microbatches=microbatches, recompute=o.recompute,
                                               layer_recompute=o.layer_recompute, prefetch_depth=int(o.prefetch_depth),
                                               priorities=dict(o.priorities), schedule=o.schedule),
                                 training=True, fused=False, input_gradient=False, first_serial=first_serial))


@pytest.mark.timeout(60)
def test_every_call_gets_the_graph_lower_gives_and_a_kind_of_call_is_lowered_once():
    layers = mlp(depth=4, width=8, seed=1)
    eng = PipelineEngine(layers, make_pool("cpu", 3), PLAN, EngineOptions(microbatches=2))
    try:
        ctx = eng.context
        starts = set()
        for call in range(5):
            first, serial = ctx.history.next_worker, ctx.history.next_serial + 1
            starts.add(first)
            want = _fresh(ctx, 2, first, serial)
            got = ctx.lower(2, training=True, fused=False, input_gradient=False)
            assert got == want, f"call {call}"
            assert [(t.worker, t.priority) for t in got.tasks] == [(t.worker, t.priority) for t in want.tasks]
            assert (got.next_worker, got.next_serial) == (want.next_worker, want.next_serial)
            assert (ctx.history.next_worker, ctx.history.next_serial) == (want.next_worker, want.next_serial)
        assert starts == {0, 1, 2}  # 5 stages a call on 3 workers: every start worker came up
        assert len(ctx.lowered) == 1
        assert next(iter(ctx.lowered.values())).lowerings == 1  # round robin: every later call turned

        ctx.lower(3, training=True, fused=False, input_gradient=False)  # another microbatch count
        assert len(ctx.lowered) == 2
    finally:
        eng.close()


@pytest.mark.timeout(60)
def test_a_layer_frozen_between_steps_gets_a_new_graph_without_its_gradient_bytes_and_trains_as_plain():
    torch.manual_seed(0)
    layers = mlp(depth=4, width=8, seed=2)
    reference = mlp(depth=4, width=8, seed=2)
    eng = PipelineEngine(layers, make_pool("cpu", 2), PLAN, EngineOptions(microbatches=2))
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 8, generator=g) for _ in range(3)]
    try:
        wgrad_bytes = []
        for step, x in enumerate(batches):
            if step == 1:  # freeze layer 0 after one step, in both
                for p in list(layers[0].parameters()) + list(reference[0].parameters()):
                    p.requires_grad_(False)
            graph = eng.context.lower(2, training=True, fused=False, input_gradient=False)
            wgrad_bytes.append(sum(t.bytes for t in graph.tasks if t.kind == "wgrad" and t.start == 0))
            (eng(x) ** 2).mean().backward()
            out = x
            for layer in reference:
                out = layer(out)
            (out ** 2).mean().backward()
        assert wgrad_bytes[0] > 0 and wgrad_bytes[1] == wgrad_bytes[2] == 0
        assert len(eng.context.lowered) == 2  # before and after the freeze
        for mine, ref in zip([p for l in layers for p in l.parameters()], [p for l in reference for p in l.parameters()]):
            assert (mine.grad is None) == (ref.grad is None)
            if ref.grad is not None:
                torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-6, atol=1e-7)
    finally:
        eng.close()
