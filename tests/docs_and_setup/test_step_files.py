"""Issue 45's readability bar: few package files execute during one steady training step
(``scripts/step_files.py``, a plain ``nn.Sequential`` on the CPU backend), and files stay short."""

from __future__ import annotations

from pathlib import Path

import pytest

from _scripts import load_script

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "src" / "lightning_roundpipe"
MOST_FILES = 15  # the bar, all files together
MOST_LINES = 500


def load_tracer():
    return load_script("step_files")


@pytest.mark.timeout(90)
def test_few_package_files_run_during_a_steady_step():
    result = load_tracer().measure()
    files = sorted(result["files"])
    assert "engine/engine.py" in files and "runtime.py" in files  # the tracer saw the step
    assert result["file_count"] <= MOST_FILES, files


def test_no_library_file_is_longer_than_the_bar():
    long = {str(p.relative_to(PACKAGE_DIR)): n for p in sorted(PACKAGE_DIR.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MOST_LINES}
    assert long == {}
