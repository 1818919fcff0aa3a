"""The planner's command, ``python -m lightning_roundpipe.plan``, and its old name ``python -m lightning_roundpipe.sim``.

The old name runs ``plan`` and ``host-bytes`` as before, and sends the simulator's studies, which left the
library for the lab, to the lab's command with the same arguments. The lab's command runs the planner too.
"""

from __future__ import annotations

import pytest

from lightning_roundpipe.planning.cli import main as plan_main
from lightning_roundpipe.sim.__main__ import main as old_main
from roundpipe_lab.analysis.cli import main as lab_main

SMALL_PLAN = ["--model", "qwen3-0.6b", "--hardware", "rtx4090", "--seq-len", "512", "--gpus", "2", "--no-max-seq",
              "--microbatches", "4"]


def outputs(capsys, main, argv) -> tuple[int, str, str]:
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.timeout(60)
def test_the_old_and_the_lab_names_print_what_the_planner_prints(capsys):
    status, planned, _ = outputs(capsys, plan_main, SMALL_PLAN)
    assert status == 0 and "Verdict: fits" in planned and "(2 x 24.0 GiB GPUs)" in planned
    assert outputs(capsys, old_main, ["plan", *SMALL_PLAN]) == (0, planned, "")
    assert outputs(capsys, lab_main, ["plan", *SMALL_PLAN]) == (0, planned, "")


def test_host_bytes_under_all_three_names(capsys):
    status, table, _ = outputs(capsys, plan_main, ["--host-bytes"])
    assert status == 0 and table.startswith("| training (Llama-3.1-8B, bf16 compute) | host bytes per parameter |")
    assert outputs(capsys, old_main, ["host-bytes"]) == (0, table, "")
    assert outputs(capsys, lab_main, ["host-bytes"]) == (0, table, "")
    status, other, _ = outputs(capsys, plan_main, ["--host-bytes", "--model", "qwen3-8b"])
    assert status == 0 and other.startswith("| training (Qwen3-8B, bf16 compute) |")


@pytest.mark.parametrize("command", ["compare", "paper", "small-steps", "scaling"])
def test_the_old_name_sends_the_studies_to_the_lab(capsys, command):
    status, out, err = outputs(capsys, old_main, [command, "--hardware", "rtx4090"])
    assert (status, out) == (2, "")
    assert err == (f"error: `python -m lightning_roundpipe.sim {command}` moved to the lab, this repository's second "
                   f"package: run `python -m roundpipe_lab.sim {command} --hardware rtx4090`\n")


def test_bad_input_names_what_to_give(capsys):
    assert outputs(capsys, plan_main, ["--hardware", "rtx4090"]) == (
        2, "", "error: --model is required (a preset name or a local Hugging Face model), or pass --host-bytes\n")
    assert outputs(capsys, plan_main, ["--model", "qwen3-0.6b"]) == (
        2, "", "error: --hardware is required (a profile name or YAML path), or pass --detect\n")
    status, out, err = outputs(capsys, old_main, [])
    assert (status, out) == (2, "") and "plan: the planner, now `python -m lightning_roundpipe.plan`" in err
    with pytest.raises(SystemExit):
        plan_main(["--model", "qwen3-0.6b", "--hardware", "rtx4090", "--gpus", "0"])
    assert "python -m lightning_roundpipe.plan: error: argument --gpus/--num-gpus: expected a positive integer, got 0" \
        in capsys.readouterr().err
