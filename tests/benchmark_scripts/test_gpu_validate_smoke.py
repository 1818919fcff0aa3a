"""benchmarks/validation/gpu_validate.py on the fake-stream backend: every check that needs no GPU runs and passes."""

import json

import pytest


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_gpu_validate_runs_on_fake_streams(tmp_path):
    from benchmarks.validation.gpu_validate import CHECKS, main

    path = tmp_path / "gpu_validate.json"
    report = main(["--device", "cpu", "--quick", "--skip", "pytest_gpu", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved["verdict"] == report["verdict"] == "pass", {k: v["summary"] for k, v in saved["checks"].items()}
    assert set(saved["checks"]) == set(CHECKS) - {"pytest_gpu"}
    failures = saved["checks"]["failures"]["details"]
    assert failures["hang"]["seconds_to_error"] <= 3.0 and failures["hang"]["threads_left"] == []
    assert saved["checks"]["virtual_workers_race"]["details"]["staleness_1"]["bit_identical"]
