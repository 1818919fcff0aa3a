"""Smoke test of benchmarks/calibration/checkpoint_integrity.py: its --quick run writes, checks and
loads a 32 MiB checkpoint and reports consistent seconds."""

import json

import pytest

from benchmarks.calibration import checkpoint_integrity


@pytest.mark.timeout(60)
def test_quick_run_reports_load_and_check_seconds(tmp_path):
    out = tmp_path / "integrity.json"
    result = checkpoint_integrity.main(["--quick", "--dir", str(tmp_path), "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["producer"] == "benchmarks.calibration.checkpoint_integrity"
    assert 32 << 20 < saved["bytes"] < (32 << 20) + (1 << 20)  # 2 tensors of 16 MiB and the pickled dict
    assert 0 < result["check_s"] < result["checked_load_s"] and result["load_s"] > 0
    assert result["extra_share"] == pytest.approx(result["checked_load_s"] / result["load_s"] - 1)
    assert not list(tmp_path.glob("*.ckpt"))  # the checkpoint went with its temporary folder
