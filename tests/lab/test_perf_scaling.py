"""GPU count as an option of the simulator's command line, and the scaling table."""

from __future__ import annotations

import pytest

from roundpipe_lab.analysis.cli import main  # the lab's command: its plan is the library's planner
from roundpipe_lab.analysis.scaling import scaling_markdown, scaling_rows
from roundpipe_lab.analysis.workload import Workload


def test_plan_takes_the_gpu_count(capsys):
    status = main(["plan", "--model", "qwen3-0.6b", "--hardware", "rtx4090", "--seq-len", "512", "--microbatches", "6",
                   "--num-gpus", "3", "--no-max-seq"])
    out = capsys.readouterr().out
    assert status == 0 and "(3 x 24.0 GiB GPUs" in out


def test_num_gpus_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "qwen3-0.6b", "--hardware", "rtx4090", "--num-gpus", "0"])
    assert "expected a positive integer, got 0" in capsys.readouterr().err


def test_scaling_rows_simulate_each_count_on_that_many_workers():
    # 64 sequences of 1024 tokens per step: compute (~0.8 s on one GPU) outweighs the 0.3 s host update.
    small = Workload(64, 8, 1, seq_len=1024)
    rows = scaling_rows(("qwen3-0.6b",), "rtx4090", (2, 1), workload=small)
    assert [r.num_gpus for r in rows] == [1, 2]
    assert rows[0].speedup == 1.0
    assert rows[1].speedup == pytest.approx(rows[1].tokens_per_s / rows[0].tokens_per_s)
    assert 1.0 < rows[1].speedup <= 2.0  # a second GPU helps, and cannot more than double the rate
    text = scaling_markdown(rows, "rtx4090")
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| ")]
    assert ["qwen3-0.6b", "2"] in [row[:2] for row in cells] and f"{rows[1].speedup:.2f}x" in text
    with pytest.raises(ValueError, match="GPU counts must be positive"):
        scaling_rows(("qwen3-0.6b",), "rtx4090", (0,))
