"""Smoke tests of the benchmark scripts (benchmarks/peers/ and the harness): model costs, cost model, table/JSON, GPU skip.

They run no timed benchmark: only the pieces the numbers rest on, on tiny inputs.
"""

import json
import math

import pytest
import torch
from torch import nn

from lightning_roundpipe.planning.partition import TIE_TOLERANCE

from benchmarks.peers import cost_model, cpu_peers, cpu_runners, gpu_bench  # noqa: E402
from benchmarks.peers.models import (  # noqa: E402
    LayerTiming,
    ShapeConfig,
    build_layers,
    head_to_block_flops,
    measure_layer_costs,
)
from benchmarks.harness import markdown_table, write_json  # noqa: E402
from benchmarks.peers.cpu_peers import CPU_COLUMNS  # noqa: E402


def linear_flops_per_token(module: nn.Module) -> int:
    """Forward matmul FLOPs per token of every nn.Linear in ``module`` (2 x in x out)."""
    return sum(2 * m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


# ------------------------------------------------------------------ the model
@pytest.mark.parametrize("key, ratio, vocab", [("paper", 3.0, 9216), ("light", 1.0, 3072)])
def test_head_costs_the_intended_number_of_blocks(key, ratio, vocab):
    shape = cpu_peers.SHAPES[key]
    assert shape.vocab == vocab
    blocks, head = build_layers(shape)
    assert len(blocks) == shape.blocks
    block_flops = linear_flops_per_token(blocks[0])
    assert block_flops == 16 * shape.hidden ** 2
    assert linear_flops_per_token(head) / block_flops == pytest.approx(ratio, abs=1e-9)
    assert head_to_block_flops(shape) == pytest.approx(ratio, abs=1e-9)
    # the quick variant is smaller but keeps the layer counts and the head ratio
    quick = cpu_peers.quick_shape(shape)
    assert (quick.blocks, quick.microbatches) == (shape.blocks, shape.microbatches)
    assert head_to_block_flops(quick) == pytest.approx(ratio, abs=1e-9)


# ------------------------------------------------------------------ the cost model
def unit_timings():
    """3 blocks (f=1, b=2) and a head of 3 blocks (f=3, b=6), in seconds."""
    return [LayerTiming(1.0, 2.0)] * 3 + [LayerTiming(3.0, 6.0)]


def test_bound_schedule_model_numbers():
    t = unit_timings()
    assert cost_model.layer_step_costs(t, recompute=True) == [4.0, 4.0, 4.0, 9.0]  # head never recomputed
    assert cost_model.layer_step_costs(t, recompute=False) == [3.0, 3.0, 3.0, 9.0]
    ranges = cost_model.bound_split(t, 2, recompute=True)
    assert ranges == [(0, 3), (3, 4)]
    assert cost_model.rank_costs(t, ranges, True) == [12.0, 9.0]
    assert cost_model.bound_step_s(t, ranges, 4, True) == 21.0 + 3 * 12.0
    assert cost_model.balance_bound_s(t, 4, 2, True) == 4 * 21.0 / 2
    assert cost_model.bound_bubble(t, ranges, 4, True) == pytest.approx(1 - 4 * 21.0 / (2 * 57.0))


def test_bound_schedules_price_a_recomputed_block_as_measured_under_checkpoint():
    # torch's checkpoint stops its recompute early, so a checkpointed block (k=3.5) costs less than
    # RoundPipe's two forwards and a backward (1 + 2 + 1 = 4); the head (f=3, b=6) is never recomputed.
    t = [LayerTiming(1.0, 2.0, checkpointed_s=3.5)] * 3 + [LayerTiming(3.0, 6.0)]
    assert cost_model.bound_layer_step_costs(t, recompute=True) == [3.5, 3.5, 3.5, 9.0]
    assert cost_model.bound_layer_step_costs(t, recompute=False) == [3.0, 3.0, 3.0, 9.0]
    assert cost_model.layer_step_costs(t, recompute=True) == [4.0, 4.0, 4.0, 9.0]  # RoundPipe's recompute
    ranges = cost_model.bound_split(t, 2, recompute=True)
    assert ranges == [(0, 3), (3, 4)]
    assert cost_model.rank_costs(t, ranges, True) == [10.5, 9.0]
    assert cost_model.bound_step_s(t, ranges, 4, True) == 19.5 + 3 * 10.5
    assert cost_model.bound_bubble(t, ranges, 4, True) == pytest.approx(1 - 4 * 19.5 / (2 * 51.0))
    # RoundPipe's balance bound keeps RoundPipe's own costs
    assert cost_model.balance_bound_s(t, 4, 2, True) == 4 * 21.0 / 2


def test_layer_costs_time_blocks_under_checkpoint_and_not_the_head():
    shape = ShapeConfig("tiny", hidden=16, blocks=2, head_ratio=1.0, seq_len=8, batch=2, microbatches=2)
    timings = measure_layer_costs(shape, reps=1)
    assert len(timings) == 3
    assert all(t.checkpointed_s is not None and t.checkpointed_s > 0 for t in timings[:2])
    assert timings[2].checkpointed_s is None


def test_the_optimizer_is_priced_per_rank_for_bound_schedules_and_whole_on_roundpipes_host():
    opt = [0.5, 0.5, 0.5, 2.0]  # seconds of one optimizer step over each layer's parameters
    assert cost_model.bound_optimizer_s(opt, [(0, 3), (3, 4)]) == 2.0  # the ranks step at once: the slowest
    assert cost_model.bound_optimizer_s(opt, [(0, 2), (2, 4)]) == 2.5
    assert cost_model.roundpipe_optimizer_s(opt, overlapped=False) == 3.5  # whole, after backward
    assert cost_model.roundpipe_optimizer_s(opt, overlapped=True) == 0.0  # hidden behind backward


def test_round_robin_model_matches_the_projects_timing_model():
    shape = ShapeConfig("unit", hidden=8, blocks=3, head_ratio=3.0, seq_len=4, batch=4, microbatches=4)
    t = unit_timings()
    for recompute in (True, False):
        rp = cost_model.roundpipe_plan(t, shape, [100] * 4, 2, recompute)
        fc, bc = cost_model.stage_costs(t, rp.forward, rp.backward, recompute)
        # The engine starts a fused run's backward per microbatch: no barrier in the model.
        assert cost_model.round_robin_step_s(fc, bc, 4, 2, barrier=False) == pytest.approx(rp.step_s, rel=1e-12)
        best, fwd, bwd = cost_model.best_plan(t, 4, 2, recompute)
        # the partitioner finds the optimum of a small model (up to its tie rule: fewer stages within 2%)
        assert best - 1e-12 <= rp.step_s <= best * (1 + TIE_TOLERANCE)
        assert best <= cost_model.best_plan(t, 4, 2, recompute, barrier=True)[0] + 1e-12
        assert best >= cost_model.balance_bound_s(t, 4, 2, recompute) - 1e-12
        assert fwd[-1] == bwd[-1] == [3, 4]  # the head is the fused last stage
        if not recompute:
            assert fwd == bwd


def test_round_robin_without_barrier_starts_backward_per_microbatch():
    # forward F (1/mb) on w0, fused head (3/mb) on w1, one backward stage (2/mb) on w0; 2 microbatches
    assert cost_model.round_robin_step_s([1.0, 3.0], [2.0], 2, 2, barrier=True) == 7.0 + 4.0
    assert cost_model.round_robin_step_s([1.0, 3.0], [2.0], 2, 2, barrier=False) == 4.0 + 2.0 + 3.0


# ------------------------------------------------------------------ table and JSON
def fake_rows():
    shape = ShapeConfig("fake", hidden=8, blocks=2, head_ratio=1.0, seq_len=10, batch=10, microbatches=2)
    R = cpu_runners.RunResult
    runs = [
        (R("roundpipe (2 CPU workers)", True, step_s=0.5, peak_rss_mib=300.0, extra_rss_mib=40.0, bubble=0.1,
           other_load=0.05), 1.6, 0.45, 0.2),
        (R("torch 1F1B (2 ranks)", True, step_s=0.8, peak_rss_mib=250.0, extra_rss_mib=30.0), 1.0, 0.72, 0.25),
        (R("torch GPipe (2 ranks)", True, step_s=1.0, peak_rss_mib=260.0, extra_rss_mib=35.0), 1.0, 0.72, 0.25),
        (R("plain (1 process, 2 threads)", True, error="RuntimeError: boom"), None, None, None),
    ]
    rows = [cpu_peers.result_row(shape, res, ideal, model, bubble) for res, ideal, model, bubble in runs]
    return cpu_peers.add_ratios(rows)


def test_table_has_the_columns_and_values():
    rows = fake_rows()
    assert [r["tokens_per_s"] for r in rows[:3]] == [200.0, 125.0, 100.0]
    assert rows[0]["ratio_vs_1f1b"] == pytest.approx(1.6)
    assert rows[2]["ratio_vs_1f1b"] == pytest.approx(0.8)
    assert rows[3]["ratio_vs_1f1b"] is None and math.isnan(rows[3]["tokens_per_s"])
    table = markdown_table([{**r, "bubble": r["bubble_text"]} for r in rows], CPU_COLUMNS).splitlines()
    assert table[0] == "| " + " | ".join(title for _, title, _ in CPU_COLUMNS) + " |"
    for title in ("system", "recompute", "tokens/s", "vs 1F1B", "ideal vs 1F1B", "peak RSS MiB", "bubble"):
        assert title in table[0]
    assert table[2] == ("| fake | roundpipe (2 CPU workers) | on | 0.500 | 0.450 | 200 | 1.60x | 1.60x | - | 300 | 40 "
                        "| 10.0% (trace) | 0.05 |")
    assert table[3].endswith("| 25.0% (model) | - |")
    assert table[5] == "| fake | plain (1 process, 2 threads) | on | - | - | - | - | - | - | - | - | - | - |"


def test_json_is_strict_and_complete(tmp_path):
    rows = fake_rows()
    path = tmp_path / "sub" / "bench.json"
    write_json(path, {"rows": rows, "targets": cpu_peers.check_targets(rows, "fake")})
    data = json.loads(path.read_text())  # strict: no NaN tokens
    assert data["rows"][3]["tokens_per_s"] is None
    assert data["rows"][3]["error"] == "RuntimeError: boom"
    assert data["rows"][0]["bubble_source"] == "trace" and data["rows"][1]["bubble_source"] == "model"
    assert {t["target"]: t["met"] for t in data["targets"]} == {
        "fake, recompute on: faster than torch 1F1B": True,
        "fake, recompute on: faster than torch GPipe": True,
        "fake, recompute on: >= 1.3x 1F1B tokens/s": True,
        "fake, recompute on: within 10% of the ideal ratio": True,
    }
    assert not any(t["disturbed"] for t in data["targets"])


def test_other_load_and_best_attempt():
    # two ranks, each 1.0 CPU s over a 2 s window in which the machine was busy 2.5 s: 0.25 cores of others
    parts = [{"window": {"wall": 2.0, "busy": 2.5, "own": 1.0}}, {"window": {"wall": 2.0, "busy": 2.4, "own": 1.0}}]
    assert cpu_runners.other_load_cores(parts) == pytest.approx(0.25)
    assert math.isnan(cpu_runners.other_load_cores([{}]))
    rows = [{"step_s": 0.9, "error": None, "other_load": 0.8}, {"step_s": 0.6, "error": None, "other_load": 0.1},
            {"step_s": float("nan"), "error": "boom", "other_load": float("nan")}]
    best = cpu_peers.best_attempt(rows)
    assert best["step_s"] == 0.6 and best["attempt_step_s"][:2] == [0.9, 0.6]
    assert not cpu_peers.is_loaded(best) and cpu_peers.is_loaded(rows[0])


# ------------------------------------------------------------------ runners, in process
def test_roundpipe_and_plain_runners_train_the_same_model():
    shape = ShapeConfig("tiny", hidden=16, blocks=2, head_ratio=2.0, seq_len=4, batch=4, microbatches=2)
    config = cpu_runners.RunConfig(steps=1, warmup=1, optimizer="sgd")
    threads = torch.get_num_threads()
    try:
        plain = cpu_runners._plain_process(shape, False, config)
        ours = cpu_runners._roundpipe_process(shape, True, config, [[0, 2], [2, 3]], [[0, 1], [1, 2], [2, 3]], 2,
                                              "measured")
    finally:
        torch.set_num_threads(threads)
    assert ours["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-5)
    assert len(ours["times"]) == len(plain["times"]) == 1
    assert 0.0 <= ours["bubble"] < 1.0
    assert ours["details"]["plan"] == "F 0:2 2:3 | B 0:1 1:2 2:3 | fused"
    assert ours["details"]["compute_tasks"] == 2 * 2 + 2 * 2  # (F0, fused) + (B1, B0), 2 microbatches each
    delay = ours["details"]["dispatch_delay_s"]
    assert delay["tasks"] == 8 and 0.0 <= delay["max"] <= delay["sum"]


# ------------------------------------------------------------------ GPU script
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_gpu_bench_skips_cleanly_without_cuda(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    assert gpu_bench.main(["--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert "CUDA is not available" in data["skipped"]
    assert data["rows"] == []
    assert "skipped" in capsys.readouterr().out


@pytest.mark.slow
def test_gpu_bench_cpu_debug_mode_runs_both_systems(tmp_path):
    path = tmp_path / "gpu_cpu.json"
    threads = torch.get_num_threads()
    try:
        code = gpu_bench.main(["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "1", "--batch", "2",
                               "--microbatches", "2", "--systems", "roundpipe,plain", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert rows[0]["first_loss"] == pytest.approx(rows[1]["first_loss"], rel=1e-5)  # same init, same data
    assert rows[0]["tokens_per_step"] == 2 * 128


def test_gpu_bench_rejects_real_sizes_on_cpu():
    with pytest.raises(SystemExit, match="debug mode for --tiny only"):
        gpu_bench.config_from_args(gpu_bench.parse_args(["--device", "cpu"]))


# ------------------------------------------------------------------ the host thread's torch threads
@pytest.mark.timeout(30)
@pytest.mark.parametrize("cores, asked, used", [(2, None, 1), (8, None, 6), (1, None, 1), (2, 2, 2), (8, 1, 1)])
def test_roundpipes_host_thread_gets_the_cores_its_workers_leave_unless_told(monkeypatch, cores, asked, used):
    monkeypatch.setattr(cpu_runners, "usable_cores", lambda: cores)
    assert cpu_runners.RunConfig(host_threads=asked).host_threads_used(2) == used
    assert cpu_peers.parse_args([]).host_threads is None


@pytest.mark.slow  # two inductor compiles: 20-60 s cold on the 2-core machine
@pytest.mark.timeout(600)
def test_early_stop_vjp_gives_the_gradients_of_forward_then_backward(tmp_path):
    from benchmarks.calibration import early_stop_recompute

    path = tmp_path / "early_stop.json"
    early_stop_recompute.main(["--quick", "--rounds", "1", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["producer"] == "benchmarks.calibration.early_stop_recompute"
    assert set(data["seconds"]) == {"compiled_forward_backward", "compiled_vjp"}
    assert data["max_grad_difference"] <= 1e-5  # fp32; measured 0 (the same kernels for what both compute)
    assert data["ratio"] == pytest.approx(data["seconds"]["compiled_vjp"] / data["seconds"]["compiled_forward_backward"])
