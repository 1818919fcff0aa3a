"""Timelines recorded by the engine: bubble fraction, priority overtaking, export from a fit."""

import json

import torch
from torch import nn

from _models import SeqModule, fit
from lightning_roundpipe import CpuWorkerPool, EngineOptions, PipelineEngine, Plan, RoundPipeStrategy


def tiny_layers(n, width=8):
    torch.manual_seed(0)
    return [nn.Linear(width, width) for _ in range(n)]


def test_balanced_plan_runs_its_lowered_schedule_on_each_worker():
    """The engine runs, on each worker's compute lane, exactly the computes its lowered graph gives that
    worker, in the graph's order. How small that schedule's bubble is belongs to the timing model
    (tests/sim/test_sim.py::test_two_workers_balanced_stages_have_the_expected_bubble, exact); a wall-clock
    bubble bound here failed under load (0.11 against 0.10 at load average 10 on 2 cores), so this test
    asserts the order, which no load can change."""
    layers = tiny_layers(8)
    plan = Plan(8, [(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 2), (2, 4), (4, 6), (6, 8)])
    pool = CpuWorkerPool(2)
    eng = PipelineEngine(layers, pool, plan, EngineOptions(microbatches=8))
    pool.trace.enabled = True
    try:
        eng(torch.randn(16, 8)).sum().backward()
        records = pool.trace.records(step=eng.step_count)
        graph = eng.last_run.graph
    finally:
        eng.close()
    computes = [r for r in records if r.queue == "compute"]
    assert len(computes) == 2 * 4 * 8  # forward and backward tasks: 4 stages x 8 microbatches each
    for worker in (0, 1):
        ran = [(r.stage, r.microbatch) for r in sorted(computes, key=lambda r: r.start) if r.worker == worker]
        lowered = [(t.stage, t.microbatch) for t in sorted(graph.tasks, key=lambda t: t.id)
                   if t.lane == "compute" and t.worker == worker]
        assert ran == lowered
        assert len(ran) == 32  # round robin over 2 workers: half of the stages' computes each


def prefetch_timeline(fifo: bool):
    """One forward on 2 workers over a slow link with weights cut in small chunks: long prefetches."""
    layers = tiny_layers(6, width=64)
    plan = Plan(6, [(0, 2), (2, 4), (4, 6)], [(0, 2), (2, 4), (4, 6)])
    pool = CpuWorkerPool(2, bandwidth_bytes_per_s=4e6, compute_delay_s=0.002, fifo_transfers=fifo)
    eng = PipelineEngine(layers, pool, plan, EngineOptions(microbatches=6, chunk_bytes=8 << 10))
    pool.trace.enabled = True
    try:
        with torch.no_grad():
            eng(torch.randn(12, 64))
        return pool.trace.records(step=eng.step_count)
    finally:
        eng.close()


def overtakes(records) -> int:
    """Activation uploads that ran between two chunks of one weight prefetch, over both workers."""
    count = 0
    for w in (0, 1):
        uploads = sorted((r for r in records if r.worker == w and r.queue == "upload"), key=lambda r: r.start)
        for i, r in enumerate(uploads):
            if r.kind == "act_in":
                before = {u.stage for u in uploads[:i] if u.kind == "weights"}
                after = {u.stage for u in uploads[i + 1:] if u.kind == "weights"}
                count += len(before & after)
    return count


def test_activation_overtakes_queued_weight_prefetch():
    assert overtakes(prefetch_timeline(fifo=False)) > 0


def test_fifo_queue_never_lets_activations_overtake():
    assert overtakes(prefetch_timeline(fifo=True)) == 0


def test_fit_logs_step_metrics_and_writes_the_timeline(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    m = SeqModule(depth=6)
    strategy = RoundPipeStrategy(microbatches=4, trace_steps=2, trace_dir=str(tmp_path), partition="auto")
    fit(m, strategy, devices=2, max_steps=3, logger=CSVLogger(str(tmp_path), name="csv"), log_every_n_steps=1)
    trace = json.loads((tmp_path / "roundpipe_trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    steps = {e["args"]["step"] for e in events}
    assert len(steps) == 2 and len(events) > 20
    png = (tmp_path / "roundpipe_timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    header = metrics.splitlines()[0]
    for key in ("roundpipe/bubble_fraction", "roundpipe/exposed_transfer_s", "roundpipe/tokens_per_s"):
        assert key in header
