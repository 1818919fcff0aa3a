"""The host-RAM figures in conf/ and docs/finetune.md are what ``sim plan`` prints (scripts/host_ram_guidance.py)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from _scripts import load_script as load_named

from lightning_roundpipe.planning.cli import main

REPO = Path(__file__).resolve().parents[2]


def guidance_script():
    return load_named("host_ram_guidance")


@pytest.mark.timeout(100)
def test_a_committed_figure_is_what_its_command_prints(capsys):
    line = next(l for l in (REPO / "conf" / "model" / "qwen3_0_6b.yaml").read_text().splitlines()
                if l.startswith("# Host RAM"))
    figure = re.search(r": ([0-9.]+ GiB) for full fine-tuning", line).group(1)
    command = shlex.split(line.split("yours: python -m lightning_roundpipe.plan ")[1].split(" [")[0])
    assert main(command) == 0
    assert f"Host memory: {figure} needed" in capsys.readouterr().out
    assert f"| `qwen3_0_6b` | 0.6B | 1+ of 8 GB | {figure} / " in (REPO / "docs" / "finetune.md").read_text()


def test_a_changed_simulator_figure_makes_the_guidance_stale(monkeypatch):
    script = guidance_script()
    monkeypatch.setattr(script, "host_gib", lambda preset, rank: "1.0 GiB")
    before = {path: path.read_text() for path in script.expected_files()}
    stale = script.stale_files()
    assert sorted(p.relative_to(REPO).as_posix() for p in stale) == sorted(
        [f"conf/model/{m.conf}.yaml" for m in script.MODELS]
        + [f"conf/experiment/{e}.yaml" for e in script.EXPERIMENTS] + ["docs/finetune.md"])
    assert {path: path.read_text() for path in before} == before  # --check writes nothing


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_committed_host_ram_figure_equals_the_simulator():
    assert guidance_script().main(["--check"]) == 0
