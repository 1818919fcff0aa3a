"""The plan report: rows in dispatch order, predictions, the text table and plain data."""

from __future__ import annotations

import json

import pytest

from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.planning.partition import partition, predict
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.planning.report import build_report

MiB = 2**20


def costs() -> CostProfile:
    # six 1 MiB layers at 10 ms forward, 64 tokens x 1 KiB activations (64 KiB per microbatch)
    return CostProfile([LayerCost(0.01, 0.01, 0.02, MiB, MiB, 1024) for _ in range(6)], tokens_per_microbatch=64)


def test_report_rows_follow_dispatch_order_with_predictions():
    plan = Plan(6, ((0, 3), (3, 6)), ((0, 2), (2, 4), (4, 6)))
    report = build_report(plan, costs(), num_workers=2, microbatches=4, stage_overhead_s=0.0)
    assert [r.stage for r in report.rows] == ["F0", "F1", "B2", "B1", "B0"]
    assert [r.direction for r in report.rows] == ["forward"] * 2 + ["backward"] * 3
    assert [r.layers for r in report.rows] == ["0:3", "3:6", "4:6", "2:4", "0:2"]
    assert [r.worker for r in report.rows] == [0, 1, 0, 1, 0]
    assert [r.predicted_s for r in report.rows] == pytest.approx([0.12, 0.12, 0.24, 0.24, 0.24])
    assert [r.weight_bytes for r in report.rows] == [3 * MiB, 3 * MiB, 2 * MiB, 2 * MiB, 2 * MiB]
    # forward: input + largest output (F0 has no activation input); backward: input + every layer's output
    assert [r.activation_bytes for r in report.rows] == [65536, 131072, 196608, 196608, 131072]
    expected = predict(plan, costs(), 2, 4, stage_overhead_s=0.0)
    assert report.predicted_step_s == pytest.approx(expected.step_s)
    assert report.predicted_bubble == pytest.approx(expected.bubble)
    # F0 0-0.12, F1 0.03-0.15; B2 after the forward 0.15-0.39, B1 0.21-0.45, B0 on worker 0 0.39-0.63
    assert report.predicted_step_s == pytest.approx(0.63)
    assert report.predicted_bubble == pytest.approx(1 - 0.96 / 1.26)


def test_table_lists_every_stage_and_the_bubble():
    plan = partition("auto", costs(), 2, 4, fused_last=True)
    report = build_report(plan, costs(), 2, 4)
    table = report.to_table()
    lines = table.splitlines()
    assert lines[0] == f"RoundPipe plan {plan.to_text()} on 2 worker(s), 4 microbatch(es)"
    assert lines[1].split() == ["stage", "direction", "layers", "worker", "predicted", "compute", "weights", "params",
                                "active", "activations"]
    stage_lines = lines[3:-1]
    assert [line.split()[0] for line in stage_lines] == [r.stage for r in report.rows]
    assert set(plan.facts.stage_seconds) == {r.stage for r in report.rows}
    assert stage_lines[len(plan.forward) - 1].split()[1] == "fused"
    assert all("MiB" in line for line in stage_lines)
    assert lines[-1] == (
        f"predicted step {report.predicted_step_s * 1e3:.1f} ms, "
        f"predicted bubble fraction {report.predicted_bubble:.1%}"
    )
    # fixed width: every row as wide as the header row's columns allow
    assert len({len(line) for line in lines[1:3]}) == 1
    # the report reuses the timing options the partitioner stored in the plan
    assert report.predicted_step_s == pytest.approx(plan.facts.predicted_step_s)
    assert report.predicted_bubble == pytest.approx(plan.facts.predicted_bubble)


def test_as_dict_is_plain_json_data():
    plan = Plan(6, ((0, 3), (3, 6)), ((0, 3), (3, 6)))
    data = build_report(plan, costs(), 2, 2).as_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["plan_text"] == "F 0:3 3:6 | B 0:3 3:6"
    assert data["rows"][0] == {
        "stage": "F0",
        "direction": "forward",
        "start": 0,
        "end": 3,
        "worker": 0,
        "predicted_s": pytest.approx(0.06),
        "weight_bytes": 3 * MiB,
        "activation_bytes": 65536,
        "compute_s": pytest.approx(0.06),
        "params": 3 * MiB // 2,  # the profile gives no counts: weight bytes over 2-byte parameters
        "active_params": 3 * MiB // 2,
        "layers": "0:3",
    }
    assert set(data) == {"plan_text", "num_workers", "microbatches", "rows", "predicted_step_s", "predicted_bubble",
                         "moe_layers", "host_between_s", "host_outside_s", "host_source"}
    assert data["moe_layers"] == []
    assert (data["host_between_s"], data["host_outside_s"], data["host_source"]) == (0.0, 0.0, "estimate")
