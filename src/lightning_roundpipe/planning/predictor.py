"""The partitioner's fast path of the one timing model (``cost/graph_timing.py``): one step of a plan.

It prices the tasks of ``lower`` stage by stage rather than task by task, so the search can price
thousands of plans. With free transfers it equals the timing model's result on the lowered graph
(``tests/cost/test_graph_timing.py``, on random plans); with a link it is an estimate, whose
error ``tests/schedule/test_lowering.py`` bounds. It charges per-stage and per-microbatch
overheads, weight prefetch behind input uploads, the barrier before backward without a fused
last stage, and the host's own work (``HostWork``). The rules: docs/design.md, design notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..cost.profile import CostProfile, StageCost, StageCostModel
from ..schedule.dispatch_order import ROUND_ROBIN, Schedule
from ..schedule.graph_task import TaskKind
from ..schedule.plan import Plan, PlanError, Stage

DEFAULT_STAGE_OVERHEAD_S = 1e-3  # per dispatched stage: event waits, kernel-launch gaps, Python dispatch


@dataclass(frozen=True)
class HostWork:
    """Host seconds of one step that no worker task covers, priced into the predicted step.

    between_s: from the last forward output on the host to the backward's dispatch (merging the
        microbatch outputs, the caller's loss on them and its backward, splitting the output
        gradient); only a run with the forward/backward barrier (no fused last stage) pays it.
    outside_s: from the end of one step's backward to the next step's forward call (the training
        loop, the optimizer's submission, loading the batch).
    """

    between_s: float = 0.0
    outside_s: float = 0.0

    def step_s(self, barrier: bool) -> float:
        """Host seconds on the step's critical path."""
        return (self.between_s if barrier else 0.0) + self.outside_s


NO_HOST_WORK = HostWork()


@dataclass(frozen=True)
class Prediction:
    """What the timing model predicts for one step of a plan."""

    step_s: float
    bubble: float  # share of worker time spent not computing
    stage_seconds: dict[str, float]  # per dispatched stage: max(compute, upload, download)
    stage_memory_bytes: dict[str, int]
    forward_s: float  # when the whole forward is back on the host
    host_s: float = 0.0  # of step_s, the host's own work (HostWork.step_s)


def dispatched_stage_costs(plan: Plan, model: StageCostModel,
                           schedule: Schedule = ROUND_ROBIN) -> list[tuple[Stage, StageCost]]:
    """(stage, cost) of every dispatched stage in dispatch order; the fused stage is the last forward one."""
    out = []
    last = len(plan.forward) - 1
    for task in schedule.dispatch(plan, 1):
        stage = task.stage
        if stage.direction == "B":
            kind = TaskKind.BACKWARD
        else:
            kind = TaskKind.FUSED if plan.fused_last and stage.index == last else TaskKind.FORWARD
        out.append((stage, model.stage(kind, stage.start, stage.end)))
    return out


SCHEDULED_MICROBATCHES = 256  # beyond this many microbatches per step, the steady state is extrapolated


def list_schedule(stages: Sequence[StageCost], workers: Sequence[int], num_forward: int, num_workers: int,
              overhead_s: float, barrier: bool = True, host: HostWork = NO_HOST_WORK,
              microbatch_overhead_s: float = 0.0) -> tuple[float, float, float]:
    """List scheduling of one step, stage ``k`` on ``workers[k]`` (a ``Schedule``'s);
    returns (step seconds, busy compute seconds, forward end).

    ``barrier``: backward waits for the whole forward and then ``host.between_s`` for the host's
    work on the outputs (runs without a fused last stage); a fused run passes False and each
    backward microbatch waits only for its own output gradient. ``host.outside_s`` is added at the end.

    The time does not grow with the microbatch count: above ``SCHEDULED_MICROBATCHES`` the step
    is scheduled for that many and for half as many, and the difference (what the extra
    microbatches add in the pipeline's steady state) extended linearly to the real count, so a
    search over plans for ``microbatches=10**6`` takes about 1.5 times as long as one for 256.
    """
    if not stages:
        return 0.0, 0.0, 0.0
    m = stages[0].microbatches
    busy = sum(sc.compute_s for sc in stages)
    schedule = lambda count: _scheduled_ends(stages, workers, num_forward, num_workers, overhead_s, barrier,  # noqa: E731
                                            host, microbatch_overhead_s, count)
    if m <= SCHEDULED_MICROBATCHES:
        step_end, forward_end = schedule(m)
    else:
        full, half = SCHEDULED_MICROBATCHES, SCHEDULED_MICROBATCHES // 2
        (step_k, forward_k), (step_h, forward_h) = schedule(full), schedule(half)
        extra = (m - full) / (full - half)
        step_end, forward_end = step_k + extra * (step_k - step_h), forward_k + extra * (forward_k - forward_h)
    return step_end + host.outside_s, busy, forward_end


def _scheduled_ends(stages, workers, num_forward, num_workers, overhead_s, barrier, host, microbatch_overhead_s,
                    m: int) -> tuple[float, float]:
    """(end of the last download, end of the forward) of one step of ``m`` microbatches."""
    compute_free = [0.0] * num_workers
    download_free = [0.0] * num_workers
    previous_start: list[float | None] = [None] * num_workers
    previous_input_upload = [0.0] * num_workers
    inputs = [0.0] * m  # when microbatch i's input is on the host
    step_end = forward_end = 0.0
    for k, sc in enumerate(stages):
        if k == num_forward and barrier:
            inputs = [forward_end + host.between_s] * m  # backward waits for the whole forward and the host
        w = workers[k]
        prefetch_from = 0.0 if previous_start[w] is None else previous_start[w] + previous_input_upload[w]
        upload_free = prefetch_from + sc.weight_upload_s
        free = compute_free[w] + overhead_s
        first_start = None
        outputs = []
        for i in range(m):
            upload_free = max(upload_free, inputs[i]) + sc.microbatch_upload_s
            start = max(free, upload_free)
            if first_start is None:
                first_start = start
            free = start + sc.microbatch_compute_s + microbatch_overhead_s
            download_free[w] = max(download_free[w], free) + sc.microbatch_download_s
            outputs.append(download_free[w])
        download_free[w] += sc.grad_download_s
        compute_free[w] = free
        previous_start[w] = first_start
        previous_input_upload[w] = m * sc.microbatch_upload_s
        step_end = max(step_end, download_free[w])
        if k < num_forward:
            forward_end = max(forward_end, outputs[-1])
        inputs = outputs
    return step_end, forward_end


def predict(
    plan: Plan,
    costs: CostProfile,
    num_workers: int,
    microbatches: int,
    *,
    link_bytes_per_second: float | None = None,
    stage_overhead_s: float = DEFAULT_STAGE_OVERHEAD_S,
    recompute: bool = True,
    host: HostWork = NO_HOST_WORK,
    microbatch_overhead_s: float = 0.0,
    schedule: Schedule = ROUND_ROBIN,
) -> Prediction:
    """Predict step time, bubble fraction and per-stage seconds/memory of ``plan`` (see module doc)."""
    check_inputs(costs, num_workers, microbatches)
    if plan.num_layers != len(costs):
        raise PlanError(f"the plan covers {plan.num_layers} layers but the cost profile has {len(costs)}")
    model = StageCostModel(costs, microbatches, link_speed(costs, link_bytes_per_second), recompute)
    staged = dispatched_stage_costs(plan, model, schedule)
    workers = [t.worker for t in schedule.dispatch(plan, num_workers)]
    step, busy, forward_end = list_schedule([sc for _, sc in staged], workers, len(plan.forward), num_workers,
                                        stage_overhead_s, barrier=not plan.fused_last, host=host,
                                        microbatch_overhead_s=microbatch_overhead_s)
    bubble = 1.0 - busy / (num_workers * step) if step > 0 else 0.0
    return Prediction(
        step_s=step,
        bubble=max(0.0, bubble),
        stage_seconds={s.name: sc.seconds for s, sc in staged},
        stage_memory_bytes={s.name: sc.memory_bytes for s, sc in staged},
        forward_s=forward_end,
        host_s=host.step_s(not plan.fused_last),
    )


def link_speed(costs: CostProfile, link_bytes_per_second: float | None) -> float | None:
    """The explicit link speed, else the one the cost estimate recorded, else None (free transfers)."""
    return link_bytes_per_second if link_bytes_per_second is not None else costs.link_bytes_per_second


def check_inputs(costs: CostProfile, num_workers: int, microbatches: int) -> None:
    """Refuse costs, worker or microbatch counts the timing model cannot price, saying why."""
    if len(costs) < 1:
        raise PlanError("the cost profile has no layers: there is nothing to partition")
    if num_workers < 1:
        raise PlanError(f"num_workers must be at least 1, got {num_workers}")
    if microbatches < 1:
        raise PlanError(f"microbatches must be at least 1, got {microbatches}")
