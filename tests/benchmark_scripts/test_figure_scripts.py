"""Smoke tests of the measurement scripts benchmarks/figures/partition_transfer.py and
benchmarks/validation/sim_validation.py.

They run each script in its --quick mode (a few seconds) and check the table and JSON carry the
expected columns and sane values; the pieces with exact answers (the cost profile that charges
one delay per task, the predictions with and without host barriers) are checked against
hand-computed numbers.
"""

import json
import math

import pytest

from benchmarks.figures import partition_transfer  # noqa: E402
from benchmarks.validation import sim_validation  # noqa: E402
from lightning_roundpipe.schedule.plan import Plan  # noqa: E402
from lightning_roundpipe.cost.view import CostView  # noqa: E402


# ------------------------------------------------------------------ partition_transfer
@pytest.fixture(scope="module")
def transfer_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("pt") / "pt.json"
    result = partition_transfer.main(["--quick", "--json", str(path)])
    return result, json.loads(path.read_text())


def test_partition_transfer_rows_and_values(transfer_run):
    result, saved = transfer_run
    names = [r["variant"] for r in result["rows"]]
    assert names == [v.name for v in partition_transfer.VARIANTS]
    cfg = partition_transfer.quick_config()
    n_timed = cfg.rounds * cfg.steps_per_round
    losses = []
    for row in result["rows"]:
        assert 0.0 <= row["bubble_fraction"] <= 1.0
        assert row["wall_step_s"] > 0 and row["trace_step_s"] > 0
        assert row["trace_step_s"] <= row["wall_step_s"] * 1.05  # the traced span lies inside the step
        assert row["exposed_transfer_s"] >= 0
        assert row["timed_steps"] == n_timed
        assert len(row["steps"]) == cfg.warmup + n_timed
        Plan.from_text(row["plan"], cfg.shape.num_layers)  # a valid plan of the pipelined model
        losses.append(row["loss_last"])
    by = {r["variant"]: r for r in result["rows"]}
    # The FIFO variant of the auto plan runs exactly the plan the auto variant ended its warm-up with.
    auto_warm = [s["plan"] for s in by["auto / priority"]["steps"]][cfg.warmup]
    assert by["auto plan / fifo"]["plan"] == auto_warm
    assert by["uniform / fifo"]["plan"] == by["uniform / priority"]["plan"]
    # Same model, seed and batch: the queue discipline never changes the numbers; the plan only
    # changes summation order.
    assert by["uniform / fifo"]["loss_last"] == by["uniform / priority"]["loss_last"]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0])
    assert list(result["plans_after_warmup"]) == names
    for name, text in result["plans_after_warmup"].items():
        assert text.startswith(f"RoundPipe plan over {cfg.shape.num_layers} layers, 2 worker(s): ")
        assert "predicted step" in text
    labels = [c["comparison"] for c in result["comparisons"]]
    assert labels == ["auto over uniform (priority queues)", "priority over FIFO (uniform plan)",
                      "priority over FIFO (auto plan)"]
    for c in result["comparisons"]:
        assert c["speedup"] > 0 and math.isfinite(c["speedup"])
    # JSON mirrors the result, with the command and machine facts.
    assert saved["command"] == ("python -m benchmarks.figures.partition_transfer --quick --json "
                                + saved["command"].split()[-1])
    assert [r["variant"] for r in saved["rows"]] == names
    assert len(saved["loadavg_before"]) == 3 and saved["cpus"] >= 1


def test_partition_transfer_table_columns(transfer_run):
    result, _ = transfer_run
    text = partition_transfer.render(result)
    header = text.splitlines()[3]
    assert header == ("| variant | plan (timed steps) | step s (wall) | step s (trace) | bubble | exposed transfer s "
                      "| timed steps | last loss |")
    line = next(l for l in text.splitlines() if l.startswith("| uniform / priority |"))
    cells = [c.strip() for c in line.strip("|").split(" | ")]
    assert len(cells) == 8  # plan pipes are escaped, so they do not split cells
    assert cells[4].endswith("%")


def test_partition_transfer_rejects_unknown_variant():
    cfg = partition_transfer.quick_config()
    with pytest.raises(ValueError, match="unknown variant"):
        partition_transfer.run_benchmark(partition_transfer.replace(cfg, variants=("nope",)))
    with pytest.raises(ValueError, match="needs|pins the plan"):
        partition_transfer.run_benchmark(partition_transfer.replace(cfg, variants=("auto plan / fifo",)))


# ------------------------------------------------------------------ sim_validation: exact pieces
def test_task_costs_charge_one_delay_per_task():
    cfg = sim_validation.ValidationConfig()
    model = sim_validation.build_model(cfg)
    plan = Plan.from_text("F 0:3 3:6 | B 0:2 2:4 4:5 5:6")
    fwd = {"F0": 0.01, "F1": 0.02}
    bwd = {"B0": 0.03, "B1": 0.04, "B2": 0.05, "B3": 0.06}
    costs = sim_validation.task_costs(plan, model, cfg, 4, fwd, bwd)
    view = CostView(costs)
    for stage in plan.forward_stages():
        assert view.forward_s(stage.start, stage.end) == fwd[stage.name]
    for stage in plan.backward_stages():
        assert view.backward_with_recompute_s(stage.start, stage.end) == bwd[stage.name]
    assert costs.layers[0].weight_bytes == (256 * 256 + 256) * 4
    assert costs.layers[5].weight_bytes == (256 * 1024 + 1024) * 4
    assert view.out_bytes(5) == 1024 * 4 * (32 // 4)  # rows per microbatch x head width x fp32
    assert view.in_bytes(0) == 256 * 4 * 8


@pytest.mark.parametrize("host_barriers", [True, False])
def test_predictions_give_the_hand_computed_step(host_barriers):
    """Two one-layer stages per direction, 2 workers, free transfers, task time d.

    F0 (w0) runs M tasks; F1 (w1) ends one task later, at (M + 1) d. With host barriers (the
    simulator's default, what the engine runs) the loss needs every microbatch, so B1 (w0)
    starts then and ends at (2M + 1) d; B0 (w1) ends one task later: the step is (2M + 2) d and
    the forward-to-backward gap 0. Without them B1 starts per microbatch as soon as w0 is free,
    at M d, before F1's last output is home: the step is (2M + 1) d and the gap -d.
    """
    d, m = 0.01, 4
    cfg = sim_validation.ValidationConfig(bandwidth_bytes_per_s=1e18, latency_s=0.0, layers=2, width=4, head_width=4,
                                          batch=8, delay_s=d)
    model = sim_validation.build_model(cfg)
    plan = Plan.from_text("F 0:1 1:2 | B 0:1 1:2")
    case = sim_validation.Case("two stages", "uniform", m)
    result = sim_validation.predict_case(plan, case, cfg, model, host_barriers=host_barriers)
    assert result.step_s == pytest.approx((2 * m + (2 if host_barriers else 1)) * d, rel=1e-9)
    gap = sim_validation.forward_backward_gap([r for r in result.timeline if r.step == 1], plan)
    assert gap == pytest.approx(0.0 if host_barriers else -d, abs=1e-9)
    # Measured task times replace the injected delay stage by stage.
    task_s = {"forward F0": d, "forward F1": d, "backward B0": 2 * d, "backward B1": 2 * d}
    slower = sim_validation.predict_case(plan, case, cfg, model, task_s, host_barriers=host_barriers)
    backward = [r.duration for r in slower.timeline if r.kind == "backward"]
    assert backward == pytest.approx([2 * d] * len(backward))


# ------------------------------------------------------------------ sim_validation: quick run
def test_sim_validation_quick_run(tmp_path):
    path = tmp_path / "sv.json"
    result = sim_validation.main(["--quick", "--json", str(path)])
    saved = json.loads(path.read_text())
    cfg = sim_validation.quick_config()
    assert [r["case"] for r in result["rows"]] == [c.name for c in cfg.cases]
    for row in result["rows"]:
        assert row["measured_step_s"] > 0 and row["sim_step_s"] > 0
        # Every measured step at least runs the injected compute of one worker's share of the tasks.
        plan = Plan.from_text(row["plan"])
        tasks = (len(plan.forward) + len(plan.backward)) * row["microbatches"]
        assert row["measured_step_s"] >= cfg.delay_s * tasks / cfg.workers
        for key in ("error", "error_tasks", "error_no_barriers"):
            assert math.isfinite(row[key]) and -1.0 < row[key] < 5.0
        assert 0.0 <= row["measured_bubble"] <= 1.0 and 0.0 <= row["sim_bubble"] <= 1.0
        # Host barriers only ever delay work: the backward waits for the whole forward output.
        assert row["sim_step_s"] >= row["sim_no_barriers_step_s"] - 1e-9
        assert row["sim_fb_gap_s"] >= -1e-9 and row["sim_no_barriers_fb_gap_s"] <= row["sim_fb_gap_s"] + 1e-9
        assert row["task_overhead_s"] > -cfg.delay_s  # every task slept at least about the delay
    text = sim_validation.render(result)
    assert "| case | plan | measured step s (wall) | traced step s | sim s | error | sim, measured task times s |" in text
    assert "(goal: within 15%)" in text
    assert saved["command"].startswith("python -m benchmarks.validation.sim_validation --quick")
    assert [r["case"] for r in saved["rows"]] == [c.name for c in cfg.cases]


# ------------------------------------------------------------------ quick_size_gap
def test_quick_size_gap_prices_each_task_from_its_layers():
    from benchmarks.figures import quick_size_gap
    from benchmarks.peers.models import LayerTiming

    timings = [LayerTiming(1.0, 2.0), LayerTiming(10.0, 20.0), LayerTiming(100.0, 200.0)]
    assert quick_size_gap.model_task_s(timings, [(0, 2), (2, 3)]) == {"F0": 11.0, "B0": 22.0, "F1": 300.0}
    assert sorted(["B0", "F1", "B2", "F0", "F2", "B1"], key=quick_size_gap.stage_order) == ["F0", "F1", "F2", "B2", "B1", "B0"]


@pytest.mark.timeout(120)
def test_quick_size_gap_run_splits_the_step_by_worker_role():
    from benchmarks.figures import quick_size_gap
    from benchmarks.peers.cpu_peers import SHAPES, quick_shape

    shape = quick_shape(SHAPES["paper"])
    rp = quick_size_gap.roundpipe_run(shape, [(0, 1), (1, 6), (6, 7)], steps=2)
    assert rp["traced_steps"] == 2
    assert set(rp["tasks"]) == {"F0", "F1", "F2", "B1", "B0"}
    # Round-robin over 2 workers: stages 0 and 2 (forward) share a worker, so do their backwards.
    assert set(rp["busy"]) == {"F1+B1", "F0+F2+B0"}
    assert set(rp["phases"]) == {"step start -> first compute", "first compute -> busiest worker's first task",
                                 "busiest worker: first task start -> last task end",
                                 "its last task end -> last compute end", "last compute end -> backward() returns",
                                 "optimizer step"}
    assert all(v >= 0 for v in rp["phases"].values())
    assert rp["phases"]["busiest worker: first task start -> last task end"] >= max(rp["busy"].values()) * 0.999
    assert set(rp["cpu"]) >= {(0, "compute"), (1, "compute"), "host", "upload", "download"}


@pytest.mark.timeout(120)
def test_quick_size_gap_quick_run_prints_its_tables(capsys):
    from benchmarks.figures import quick_size_gap

    assert quick_size_gap.main(["--quick", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 CPU worker(s)" in out and "(median of 10; 10 steps' timelines)" in out
    assert out.count("## round ") == 1
    # One worker runs every stage: one role holding all five tasks.
    assert "| F0+F1+F2+B1+B0 |" in out
    assert "| step start -> first compute |" in out and "the four lanes" in out
