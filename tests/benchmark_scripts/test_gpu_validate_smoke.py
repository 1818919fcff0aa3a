"""benchmarks/validation/gpu_validate.py: its command line, its report's form, its check registry and the
checks that run on the CPU (fake streams); the GPU-only parts skip cleanly without a GPU."""

import json

import pytest
import torch

from benchmarks.validation import gpu_validate
from benchmarks.validation.gpu_validate import CHECKS, REGISTRY, main, parse_args, validate_report

GPU_ONLY = {"device_syncs", "bandwidth", "memory"}


def test_the_registry_names_every_check_of_the_issue_once_in_order():
    assert CHECKS == ("environment", "parity_fp32", "parity_bf16_qwen3", "dropout_recompute", "jitter_bit_identical",
                      "device_syncs", "throughput", "bandwidth", "memory", "failures")
    assert {n for n, c in REGISTRY.items() if c.gpu_only} == GPU_ONLY
    assert all(c.what and callable(c.run) for c in REGISTRY.values())


def test_the_command_line_and_its_refusals(capsys):
    args = parse_args(["--device", "cpu", "--quick", "--gpus", "2", "--only", "environment", "--json", "r.json"])
    assert (args.device, args.quick, args.gpus, args.only, args.json, args.dry_run) == (
        "cpu", True, 2, ["environment"], "r.json", False)
    assert parse_args([]).json == "gpu_validate.json" and parse_args([]).device == "cuda"
    with pytest.raises(SystemExit):
        parse_args(["--gpus", "0"])
    assert "--gpus must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--only", "no_such_check"])


@pytest.mark.timeout(60)
def test_a_dry_run_writes_the_reports_form_with_every_check_skipped(tmp_path):
    path = tmp_path / "report.json"
    report = main(["--dry-run", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert validate_report(saved) == [] and saved["producer"] == "benchmarks.validation.gpu_validate"
    assert list(saved["checks"]) == list(CHECKS) and saved["verdict"] == report["verdict"] == "pass"
    assert {c["verdict"] for c in saved["checks"].values()} == {"skip"}
    assert saved["checks"]["memory"]["summary"] == "dry run: " + REGISTRY["memory"].what


def test_the_report_checker_names_what_is_wrong():
    assert validate_report({"checks": {"x": {"verdict": "maybe"}}, "verdict": "?"})[:2] == [
        "missing key 'producer'", "missing key 'started'"]
    problems = validate_report({"checks": {"x": {"verdict": "maybe"}}, "verdict": "?"})
    assert "unknown check 'x'" in problems and "check 'x' has verdict 'maybe'" in problems
    assert "overall verdict '?'" in problems


@pytest.mark.timeout(60)
def test_the_cpu_self_test_runs_what_needs_no_gpu_and_skips_the_gpu_only_checks(tmp_path):
    """The cheap part of the self-test (the whole of it is the slow test below)."""
    path = tmp_path / "report.json"
    report = main(["--device", "cpu", "--quick", "--only", "environment", "device_syncs", "bandwidth", "memory",
                   "--json", str(path)])
    saved = json.loads(path.read_text())
    assert validate_report(saved) == []
    verdicts = {k: v["verdict"] for k, v in saved["checks"].items()}
    assert verdicts == {"environment": "pass", "device_syncs": "skip", "bandwidth": "skip", "memory": "skip"}
    assert saved["checks"]["device_syncs"]["summary"] == "needs a GPU (CPU self-test)"
    assert saved["checks"]["environment"]["details"]["usable_cpus"] >= 1 and report["verdict"] == "pass"


def test_a_check_that_crashes_is_a_failed_check_and_the_run_goes_on(tmp_path, monkeypatch):
    def broken(ctx):
        raise KeyError("planner.costs")  # the kind of bug the first version had

    monkeypatch.setitem(REGISTRY, "parity_fp32", gpu_validate.Check(broken, False, "broken"))
    report = main(["--device", "cpu", "--only", "parity_fp32", "environment", "--json", str(tmp_path / "r.json")])
    assert report["checks"]["parity_fp32"]["verdict"] == "fail"
    assert report["checks"]["parity_fp32"]["summary"] == "KeyError: 'planner.costs'"
    assert "Traceback" in report["checks"]["parity_fp32"]["details"]["traceback"]
    assert report["checks"]["environment"]["verdict"] == "pass" and report["verdict"] == "fail"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.timeout(300)
def test_on_a_gpu_the_syncs_and_failures_checks_pass(tmp_path):
    report = main(["--gpus", "1", "--quick", "--only", "environment", "device_syncs", "failures",
                   "--json", str(tmp_path / "r.json")])
    assert report["verdict"] == "pass", {k: v["summary"] for k, v in report["checks"].items()}


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_gpu_validate_runs_on_fake_streams(tmp_path):
    path = tmp_path / "gpu_validate.json"
    report = main(["--device", "cpu", "--quick", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert validate_report(saved) == []
    assert saved["verdict"] == report["verdict"] == "pass", {k: v["summary"] for k, v in saved["checks"].items()}
    assert {k for k, v in saved["checks"].items() if v["verdict"] == "skip"} == GPU_ONLY
    failures = saved["checks"]["failures"]["details"]
    assert failures["hang"]["seconds_to_error"] <= 3.0 and failures["hang"]["threads_left"] == []
    assert all(failures[k]["next_step_max_abs_error"] <= 1e-5 for k in ("exception", "out_of_memory", "hang"))
    assert saved["checks"]["jitter_bit_identical"]["details"]["shared_staleness_1"]["bit_identical"]


@pytest.mark.timeout(60)
def test_the_simulators_prediction_for_the_throughput_runs_plan_and_workload():
    from lightning_roundpipe import simple_plan

    ctx = gpu_validate.Ctx("cpu", False, 1)
    ctx.cuda = True  # the GPU shapes, without a GPU
    qwen = gpu_validate.shapes(ctx)[0]
    assert (qwen.name, qwen.layers, qwen.seq) == ("qwen3-1.7b", 28, 2048)
    tokens_per_s, note = gpu_validate.predicted_tokens_per_s(simple_plan(30, 1, fused_last=True), 2, qwen,
                                                             "NVIDIA H200", 1, 2)
    assert note == "h200 profile, 2 microbatches, eager layers" and 1e3 < tokens_per_s < 1e6
    compiled, compiled_note = gpu_validate.predicted_tokens_per_s(simple_plan(30, 1, fused_last=True), 2, qwen,
                                                                  "NVIDIA H200", 1, 2, compiled_layers=True)
    # One stage of 2 microbatches is bound by the host optimizer and the transfers, not by launches: compiled
    # layers change nothing there (they were 1 ulp faster before the bf16 pricing of 2026-12-06, by chance).
    assert compiled_note == "h200 profile, 2 microbatches, compiled layers" and compiled == pytest.approx(tokens_per_s)
    # the CUDA backend's default: fewer launches make a launch-bound step faster (4 stages x 8 microbatches: 1.15x)
    plan = simple_plan(30, 4, fused_last=True)
    eager_8, _ = gpu_validate.predicted_tokens_per_s(plan, 8, qwen, "NVIDIA H200", 1, 8)
    compiled_8, _ = gpu_validate.predicted_tokens_per_s(plan, 8, qwen, "NVIDIA H200", 1, 8, compiled_layers=True)
    assert compiled_8 > 1.1 * eager_8
    with pytest.raises(ValueError, match="the cost profile has 30 layers, the plan 12"):
        gpu_validate.predicted_tokens_per_s(simple_plan(12, 1), 2, qwen, "NVIDIA H200", 1, 2)
