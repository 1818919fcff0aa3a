"""``python -m roundpipe_lab.sim paper``: its rows, their JSON schema, and the reference's figures."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from roundpipe_lab.analysis import paper
from roundpipe_lab.analysis.cli import main
from roundpipe_lab.analysis.own_engine import Setup, SetupResult
from lightning_roundpipe.cost.hardware import load_hardware

SYSTEMS = ["reference (measured)", "reference (simulated)", "ours: defaults", "ours: best exact",
           "ours: best exact, reference precision",
           "Megatron-PP (measured)", "Mobius (measured)"]


@pytest.fixture
def stub_simulator(monkeypatch):
    """Every simulated setup at 1000 tokens/s, its fp16 ones at 2000: the rows without minutes of simulation."""
    def simulate(run, hardware, setup, *, optimizer_steps=3, seq_len=None):
        m = setup.microbatches if isinstance(setup.microbatches, int) else 10
        return SetupResult(setup, m, setup.calls or run.stale.calls, 2000.0 if setup.precision == "fp16-acc" else 1000.0)
    monkeypatch.setattr(paper, "simulate_setup", simulate)


@pytest.mark.timeout(60)
def test_paper_json_schema(stub_simulator, tmp_path, capsys):
    path = tmp_path / "paper.json"
    assert main(["paper", "--seq-len", "2048", "--models", "qwen3-32b", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [r["system"] for r in rows] == SYSTEMS
    for r in rows:
        assert set(r) == {"model", "system", "simulated", "measured", "setting"} and r["model"] == "qwen3-32b"
        assert r["simulated"] is None or isinstance(r["simulated"], float)
        assert r["measured"] is None or isinstance(r["measured"], int)
    by = {r["system"]: r for r in rows}
    assert by["reference (measured)"] == dict(model="qwen3-32b", system="reference (measured)", simulated=None,
                                              measured=5516, setting="published")
    assert (by["reference (simulated)"]["simulated"], by["reference (simulated)"]["measured"]) == (2000.0, 5516)
    assert (by["ours: defaults"]["simulated"], by["ours: defaults"]["measured"]) == (1000.0, None)
    assert by["ours: best exact, reference precision"]["simulated"] == 2000.0
    assert by["Megatron-PP (measured)"]["measured"] is None and by["Mobius (measured)"]["measured"] == 2552
    out = capsys.readouterr().out
    assert "| qwen3-32b | reference (simulated) " in out and "0.36x" in out  # 2000 / 5516


@pytest.mark.timeout(60)
def test_paper_rows_leave_measured_out_at_another_length(stub_simulator):
    rows = paper.paper_rows("rtx4090", ("qwen3-1.7b",), seq_len=4096)
    assert all(r["measured"] is None for r in rows)
    quick = paper.config_rows(rows)
    assert [r["config"] for r in quick] == ["reference_setup", "default", "best_exact", "best_exact_reference_precision"]
    assert all(set(r) == {"model", "config", "tokens_per_s", "ours_over_measured", "setting"} for r in quick)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reference_simulated_within_20_percent_of_the_published_figure():
    rows = paper.paper_rows("rtx4090", ("qwen3-1.7b",))
    ref = next(r for r in rows if r["system"] == paper.REFERENCE_SIMULATED)
    assert abs(ref["simulated"] / ref["measured"] - 1) < 0.2


@pytest.mark.timeout(60)
def test_own_engine_reference_quick_json(stub_simulator, tmp_path):
    from benchmarks.figures.own_engine_reference import main as benchmark

    path = tmp_path / "quick.json"
    benchmark(["--quick", "--models", "qwen3-1.7b", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [r["config"] for r in rows] == ["reference_setup", "default", "best_exact", "best_exact_reference_precision"]
    assert [r["tokens_per_s"] for r in rows] == [2000.0, 1000.0, 1000.0, 2000.0]
    assert rows[1]["ours_over_measured"] == pytest.approx(1000 / 65_417)


@pytest.mark.timeout(30)
def test_exact_candidates_step_early_under_the_loss_scaler_as_the_engine_does(monkeypatch):
    """With the failed-step undo (the default) layers step early under fp16's loss scaler; without it the
    optimizer waits for every gradient."""
    hw = load_hardware("rtx4090")
    fp16 = paper.exact_candidates(hw, 2, "fp16-acc")
    assert [(s.microbatches, s.calls, s.partition, s.undo, s.wait_all_grads, s.host_unscale) for s in fp16] == [
        (20, 1, "reference", True, False, True), (60, 1, "reference", True, False, True),
        (60, 1, paper.PLANNED_PARTITION, True, False, True),
        (30, 2, paper.PLANNED_PARTITION, True, False, True)]  # each update unscales its gradient first
    assert not any(s.host_unscale for s in paper.exact_candidates(hw, 2, "bf16-mixed"))
    monkeypatch.setattr(paper, "our_default", lambda hardware: replace(Setup(), undo=False))
    assert all(s.wait_all_grads for s in paper.exact_candidates(hw, 2, "fp16-acc"))
    assert not any(s.wait_all_grads for s in paper.exact_candidates(hw, 2, "bf16-mixed"))
