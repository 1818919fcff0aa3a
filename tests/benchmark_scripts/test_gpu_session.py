"""benchmarks/validation/gpu_session.py: the GPU machine's validation run. Its whole quick run on the fake CUDA
driver (the CI run that keeps it from rotting, with Hydra, OmegaConf and datasets unimportable, as on the GPU
image), and its budget, deadline and crash handling."""

import json
import subprocess
import sys
import time

import pytest

from _blocked_imports import REPO, blocking_site
from benchmarks.validation import gpu_session
from benchmarks.validation.gpu_session import PARTS, parse_args, part_result

ORDER = ["environment", "lightning_parity", "gpu_tests", "plain_vs_pipeline", "device_syncs", "failures",
         "compiled_layers"]


def test_the_parts_run_in_the_issues_order_and_the_command_line_refuses_a_bad_budget(capsys):
    assert list(PARTS) == ORDER
    args = parse_args(["--out", "d"])
    assert (args.budget, args.device, args.quick, args.parts, args.part) == (480.0, "cuda", False, ORDER, None)
    with pytest.raises(SystemExit):
        parse_args(["--out", "d", "--budget", "0"])
    assert "--budget must be positive, got 0.0" in capsys.readouterr().err


DEFAULT_PARTS = ["environment", "gpu_tests", "plain_vs_pipeline", "failures"]  # about 25 s of the whole run's 64 s
CHECK_MODULES = {"environment": "session_environment", "lightning_parity": "lightning_parity",
                 "plain_vs_pipeline": "plain_vs_pipeline", "device_syncs": "syncs", "failures": "failures",
                 "compiled_layers": "compiled"}


def quick_fake_run(tmp_path, parts: list[str]) -> tuple[dict, object]:
    """The CI command of docs/gpu_validation.md (only ``parts``), with Hydra, OmegaConf and datasets blocked."""
    out = tmp_path / "out"
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "benchmarks.validation.gpu_session", "--device", "fake_cuda",
                          "--quick", "--out", str(out), "--parts", *parts], cwd=REPO,
                         env=blocking_site(tmp_path / "site"), capture_output=True, text=True, timeout=390)
    print(f"gpu_session --device fake_cuda --quick --parts {' '.join(parts)}: {time.monotonic() - t0:.0f}s")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "gpu_session.json").read_text())
    assert list(report["parts"]) == parts and report["verdict"] == "pass"
    verdicts = {name: part["verdict"] for name, part in report["parts"].items()}
    assert verdicts == {name: "skip" if name == "gpu_tests" else "pass" for name in parts}, verdicts
    assert sorted(p.name for p in out.iterdir()) == ["gpu_session.json", "gpu_session.log", "memory.txt", "trace.json"]
    assert "ModuleNotFoundError" not in (out / "gpu_session.log").read_text()
    return report, out


@pytest.mark.timeout(200)
def test_the_quick_fake_driver_run_passes_its_cheaper_parts_with_the_job_dependencies_blocked(tmp_path):
    """The default run: the environment, the plain-vs-pipeline comparison and the failure cases (the whole run
    is the slow test below); with every part's check module imported on an image without the job's packages."""
    assert set(CHECK_MODULES) | {"gpu_tests"} == set(ORDER)
    imports = "; ".join(f"import benchmarks.validation.gpu_checks.{m}" for m in CHECK_MODULES.values())
    run = subprocess.run([sys.executable, "-c", imports + "; print('imported')"], cwd=REPO,
                         env=blocking_site(tmp_path / "site0"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr[-3000:]
    report, _ = quick_fake_run(tmp_path, DEFAULT_PARTS)
    pipeline = report["parts"]["plain_vs_pipeline"]["details"]["pipeline"]
    assert pipeline["peak_weight_bytes"] <= 2 * pipeline["largest_stage_bytes"] and pipeline["stages"] > 4
    assert "roundpipe-optim" in pipeline["optimizer_threads"]
    failures = report["parts"]["failures"]["details"]
    assert set(failures) == {"exception", "out_of_memory", "hang", "device_assert"}
    assert all(case["names_the_task"] and not case["threads_left"] for case in failures.values())


@pytest.mark.slow  # 64 s; the default test above runs its cheaper parts and imports every part's checks
@pytest.mark.timeout(400)
def test_the_quick_fake_driver_run_passes_every_part_with_the_job_dependencies_blocked(tmp_path):
    """Exactly the CI command of docs/gpu_validation.md: exit 0, a verdict for every part (pass, and skip only
    for the GPU-only tests), at most the four files, every process of it without Hydra, OmegaConf or datasets."""
    report, out = quick_fake_run(tmp_path, ORDER)
    parity = report["parts"]["lightning_parity"]["details"]
    assert parity["fp32_three_workers"]["worst_grad_rel_error"] <= 1e-5 and len(parity["bf16_qwen3"]["losses"]) == 5
    pipeline = report["parts"]["plain_vs_pipeline"]["details"]["pipeline"]
    assert pipeline["peak_weight_bytes"] <= 2 * pipeline["largest_stage_bytes"] and pipeline["stages"] > 4
    assert "roundpipe-optim" in pipeline["optimizer_threads"]
    failures = report["parts"]["failures"]["details"]
    assert set(failures) == {"exception", "out_of_memory", "hang", "device_assert"}
    assert all(case["names_the_task"] and not case["threads_left"] for case in failures.values())
    compiled = report["parts"]["compiled_layers"]["details"]
    assert compiled["graphs"] and compiled["recompiles"] == 0


@pytest.mark.timeout(120)
def test_a_part_past_its_deadline_is_killed_and_fails_and_one_the_budget_cannot_reach_is_skipped(tmp_path, capsys):
    args = parse_args(["--device", "fake_cuda", "--quick", "--out", str(tmp_path)])
    with open(tmp_path / "gpu_session.log", "w") as log:
        t0 = time.monotonic()
        entry = gpu_session.spawn("lightning_parity", args, 0.5, log)  # cannot even import torch in 0.5 s
    assert time.monotonic() - t0 < 10
    assert entry["verdict"] == "fail" and entry["summary"] == "timed out: killed after its deadline of 0.5s"
    assert gpu_session.main(["--device", "fake_cuda", "--quick", "--budget", "10", "--parts", "environment",
                             "gpu_tests", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_session.json").read_text())
    assert report["parts"]["environment"]["verdict"] == "skip"
    assert report["parts"]["environment"]["summary"].startswith("no budget left (")
    assert report["parts"]["gpu_tests"]["summary"].startswith("needs a GPU")


def test_a_part_that_dies_without_a_result_fails_with_its_last_lines():
    entry = part_result("Traceback ...\nSegmentation fault", -11, False, 60, 3.0)
    assert entry["verdict"] == "fail"
    assert entry["summary"] == "the part's process exited -11 without a result: Traceback ... | Segmentation fault"
    ok = part_result('noise\nGPU_SESSION_RESULT {"verdict": "pass", "summary": "s", "seconds": 1, "details": {}}',
                     0, False, 60, 2.5)
    assert ok == {"verdict": "pass", "summary": "s", "seconds": 2.5, "details": {}}
