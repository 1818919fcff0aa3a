"""A readable account of a plan: each stage's layers, predicted time and memory, and the step.

``build_report(plan, costs, num_workers, microbatches).to_table()`` prints what the partitioner
expects before anything runs (predictions from ``partition.predict``), so a user can see why the
plan looks as it does and compare with the measured trace: per stage compute next to weight
bytes and parameters (all held, and those a token runs through, for MoE), and the predicted step
with the host's own work (``HostWork``), estimated or measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..cost.profile import CostProfile, StageCostModel, format_bytes, format_count, format_seconds
from ..cost.text_table import render_table
from .predictor import DEFAULT_STAGE_OVERHEAD_S, NO_HOST_WORK, HostWork, dispatched_stage_costs, link_speed, predict
from ..schedule.dispatch_order import ROUND_ROBIN, Schedule
from ..schedule.plan import Plan


@dataclass(frozen=True)
class ReportRow:
    """One dispatched stage."""

    stage: str  # "F0", "B3"; the fused stage is named after its forward stage
    direction: str  # "forward", "backward" or "fused"
    start: int  # first layer
    end: int  # one past the last layer
    worker: int  # the worker it runs on in the first step (round-robin order)
    predicted_s: float  # max(compute, upload, download) for all microbatches
    weight_bytes: int
    activation_bytes: int  # one microbatch's activations held on the worker
    compute_s: float = 0.0  # compute alone for all microbatches (the rest of predicted_s is transfers)
    params: int = 0  # parameters the stage holds (their weights are uploaded)
    active_params: int = 0  # of those, the ones a token runs through (MoE: top_k of E experts)

    @property
    def layers(self) -> str:
        """The row's layer range as ``start:end``."""
        return f"{self.start}:{self.end}"


@dataclass(frozen=True)
class MoeLayerShape:
    """A layer with routed experts: parameters it holds versus those one token runs through."""

    layer: int
    params: int
    active_params: int


@dataclass
class PlanReport:
    """Per-stage predictions of a plan and the predicted step."""

    plan_text: str
    num_workers: int
    microbatches: int
    rows: list[ReportRow] = field(default_factory=list)
    predicted_step_s: float = 0.0
    predicted_bubble: float = 0.0
    moe_layers: list[MoeLayerShape] = field(default_factory=list)
    host_between_s: float = 0.0  # host work inside the forward/backward barrier (0 with a fused last stage)
    host_outside_s: float = 0.0  # host work between two steps
    host_source: str = "estimate"  # "estimate" or "measured"

    def to_table(self) -> str:
        """Fixed-width text table (``rich.table``), one line per stage in dispatch order, then the MoE cost shape
        (when the model has routed experts) and the step summary."""
        header = ("stage", "direction", "layers", "worker", "predicted", "compute", "weights", "params", "active",
                  "activations")
        lines = [
            (r.stage, r.direction, r.layers, str(r.worker), format_seconds(r.predicted_s), format_seconds(r.compute_s),
             format_bytes(r.weight_bytes), format_count(r.params), format_count(r.active_params),
             format_bytes(r.activation_bytes))
            for r in self.rows
        ]
        out = [f"RoundPipe plan {self.plan_text} on {self.num_workers} worker(s), {self.microbatches} microbatch(es)"]
        out.append(render_table(header, lines, right=range(3, len(header))))  # text left, numbers right
        out.extend(self.moe_lines())
        if self.host_between_s or self.host_outside_s:
            out.append(
                f"host ({self.host_source}): {format_seconds(self.host_between_s)} between forward and backward "
                f"(merging microbatch outputs, the loss and its backward on them), "
                f"{format_seconds(self.host_outside_s)} between steps (loop, optimizer submission, data)"
            )
        out.append(
            f"predicted step {format_seconds(self.predicted_step_s)}, "
            f"predicted bubble fraction {self.predicted_bubble:.1%}"
        )
        return "\n".join(out)

    def moe_lines(self) -> list[str]:
        """One line per distinct MoE layer shape: parameters held versus run per token."""
        shapes: dict[tuple[int, int], list[int]] = {}
        for m in self.moe_layers:
            shapes.setdefault((m.params, m.active_params), []).append(m.layer)
        return [
            f"MoE layers {', '.join(map(str, layers))}: {format_count(params)} parameters each, "
            f"{format_count(active)} run per token ({params / active:.1f}x the bytes per FLOP of a dense layer)"
            for (params, active), layers in shapes.items()
        ]

    def as_dict(self) -> dict:
        """Plain data (JSON-ready)."""
        data = asdict(self)
        for row, r in zip(data["rows"], self.rows):
            row["layers"] = r.layers
        return data

    def __str__(self) -> str:
        return self.to_table()


def build_report(
    plan: Plan,
    costs: CostProfile,
    num_workers: int,
    microbatches: int,
    *,
    link_bytes_per_second: float | None = None,
    stage_overhead_s: float | None = None,
    recompute: bool | None = None,
    host: HostWork = NO_HOST_WORK,
    host_source: str = "estimate",
    microbatch_overhead_s: float = 0.0,
    schedule: Schedule = ROUND_ROBIN,
) -> PlanReport:
    """Report of ``plan`` under ``costs``; the timing-model options default to those stored in
    ``plan.facts`` by ``partition.partition``, then to the partitioner's defaults. ``host``:
    the host's own work, priced into the predicted step (``host_source`` says where it came from)."""
    facts = plan.facts
    link = link_speed(costs, link_bytes_per_second if link_bytes_per_second is not None else facts.link_bytes_per_second)
    if stage_overhead_s is None:
        stage_overhead_s = DEFAULT_STAGE_OVERHEAD_S if facts.stage_overhead_s is None else facts.stage_overhead_s
    if recompute is None:
        recompute = True if facts.recompute is None else facts.recompute
    prediction = predict(
        plan, costs, num_workers, microbatches,
        link_bytes_per_second=link, stage_overhead_s=stage_overhead_s, recompute=recompute, host=host,
        microbatch_overhead_s=microbatch_overhead_s, schedule=schedule,
    )
    model = StageCostModel(costs, microbatches, link, recompute)
    workers = {task.stage.name: task.worker for task in schedule.dispatch(plan, num_workers)}
    params, active = costs.layer_params(), costs.layer_active_params()
    rows = [
        ReportRow(
            stage=stage.name,
            direction=sc.kind,
            start=stage.start,
            end=stage.end,
            worker=workers[stage.name],
            predicted_s=sc.seconds,
            weight_bytes=sc.weight_bytes,
            activation_bytes=sc.activation_bytes,
            compute_s=sc.compute_s,
            params=sum(params[stage.start:stage.end]),
            active_params=sum(active[stage.start:stage.end]),
        )
        for stage, sc in dispatched_stage_costs(plan, model, schedule)
    ]
    moe = [MoeLayerShape(i, p, a) for i, (p, a) in enumerate(zip(params, active)) if 0 < a < p]
    between = 0.0 if plan.fused_last else host.between_s
    return PlanReport(plan.to_text(), num_workers, microbatches, rows, prediction.step_s, prediction.bubble, moe,
                      host_between_s=between, host_outside_s=host.outside_s, host_source=host_source)
