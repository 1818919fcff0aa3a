"""What a call measured: (stage, kind, seconds) per compute task, read from the pool's trace records."""

from __future__ import annotations

from ..schedule.plan import Stage
from ..workers.pool import WorkerPool


def call_measurements(pool: WorkerPool, step: int, stages: dict[str, Stage], kept_graph: bool
                      ) -> list[tuple[Stage, str, float]]:
    """(stage, kind, seconds) of every compute task of call ``step``.

    Kinds are "forward", "fused", and "backward" (with recompute, i.e. not ``kept_graph``:
    "recompute_backward", the recompute and the backward proper in one task; with layer-grain
    recompute, backward and fused tasks are "layer_recompute_backward": a forward without grad,
    the recompute and the backward). Read once every compute has finished (after backward, or
    after an evaluation forward); the records are dropped then unless the timeline keeps them.
    """
    pool.finish_step()  # device backends add their task records here
    trace = pool.trace
    records = [r for r in trace.records(step) if r.queue == "compute"] if trace.recording else []
    if not trace.enabled:
        trace.discard_step(step)
    out = []
    for r in records:
        stage = stages.get(r.stage)
        if stage is None:
            continue
        if r.kind in ("layer_backward", "layer_fused"):
            kind = "layer_recompute_backward"
        else:
            kind = "recompute_backward" if r.kind == "backward" and not kept_graph else r.kind
        out.append((stage, kind, r.duration))
    return out
