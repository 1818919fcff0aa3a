"""The benchmarks' shared harness and layout: common flags, JSON naming its producer, one index of
every script, and the documented old command names still running the moved script, with a deprecation."""

import importlib
import json
import os
import re
import runpy
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks import old_names
from benchmarks.harness import cli, cpu_seconds_by_thread_name, producer_name, write_json

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
FOLDERS = ("peers", "calibration", "validation", "figures")


def scripts() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (BENCHMARKS / folder).glob("*.py") if p.name != "__init__.py")


def test_common_flags_are_spelled_once():
    args = cli("demo", quick="short run").parse_args(["--quick", "--json", "out.json"])
    assert args.quick is True and args.json == "out.json"
    plain = cli("demo", json_help=None, json_default=None)
    assert not hasattr(plain.parse_args([]), "json") and not hasattr(plain.parse_args([]), "quick")
    assert cli("demo", json_default="gpu_validate.json").parse_args([]).json == "gpu_validate.json"


def test_a_report_names_its_producer_and_is_strict_json(tmp_path):
    path = tmp_path / "deep" / "out.json"
    write_json(path, {"x": float("nan"), "rows": [1.5, float("inf")], "obj": Path("a")})
    data = json.loads(path.read_text())  # strict: no NaN tokens
    assert data == {"producer": "tests.benchmark_scripts.test_harness", "x": None, "rows": [1.5, None], "obj": "a"}
    write_json(path, {"producer": "kept"}, producer="ignored")
    assert json.loads(path.read_text()) == {"producer": "kept"}
    assert producer_name(BENCHMARKS / "calibration" / "dispatch_cost.py") == "benchmarks.calibration.dispatch_cost"


@pytest.mark.timeout(60)
def test_a_calibration_script_writes_a_file_naming_itself(tmp_path):
    from benchmarks.calibration import host_accumulate_cost

    path = tmp_path / "accumulate.json"
    host_accumulate_cost.main(["--params", "4096", "--rounds", "1", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["producer"] == "benchmarks.calibration.host_accumulate_cost"
    assert data["params"] == 4096 and set(data["seconds"]) == {"cast-scale-add", "add-alpha", "adam"}


def test_the_index_lists_every_script_once():
    readme = (BENCHMARKS / "README.md").read_text()
    index = readme.split("## Index", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| ([^|]+) \|", index, flags=re.M)
    named = [name.strip("` ") for row in listed for name in row.split(",")]
    expected = [str(p.relative_to(BENCHMARKS)) for p in scripts()]
    assert sorted(n for n in named if n.endswith(".py")) == sorted(expected)


def test_every_json_writing_script_uses_the_harness():
    for path in scripts():
        text = path.read_text()
        assert "json.dump(" not in text and "write_text(json" not in text, path


def test_no_module_at_the_top_re_exports_a_script():
    top = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    assert top == ["__init__.py", "harness.py", "old_names.py"]


def test_every_old_name_leads_to_a_script_or_to_where_its_results_went():
    for old, new in old_names.MOVED.items():
        assert (BENCHMARKS / (new.replace(".", "/") + ".py")).exists(), f"benchmarks.{old} points to a gone script"
        assert new.rpartition(".")[2] == old
    for old in old_names.REMOVED:
        assert not list(BENCHMARKS.glob(f"*/{old}.py")), f"{old} still exists: move it to MOVED"
    assert "## What the removed investigations found" in (BENCHMARKS / "README.md").read_text()


@pytest.mark.parametrize("old", sorted(old_names.MOVED))
def test_an_old_command_name_warns_on_stderr_and_runs_the_moved_script(old, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"benchmarks.{old}", "--help"])
    with pytest.raises(SystemExit) as exited:  # argparse's --help: the moved script's own parser ran
        runpy.run_module(f"benchmarks.{old}", run_name="__main__")
    out, err = capsys.readouterr()
    assert exited.value.code == 0
    assert err == f"python -m benchmarks.{old} is deprecated; run python -m benchmarks.{old_names.MOVED[old]} (same arguments)\n"
    assert re.search(rf"^usage: {old}\.py ", out, flags=re.M), out[:300]  # the moved script's own parser
    assert sys.argv[0] == f"benchmarks.{old}"  # put back after the run


def test_a_removed_investigations_old_name_says_where_its_results_are(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmarks.join_before_hooks_cost"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("benchmarks.join_before_hooks_cost", run_name="__main__")
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "benchmarks.join_before_hooks_cost was a one-off investigation and has been removed; its results: "
        "benchmarks/README.md, 'What the removed investigations found'\n")


def test_an_old_name_is_a_command_only_and_importing_it_names_the_new_module():
    with pytest.raises(ImportError, match=r"^benchmarks.cpu_peers is only an old command name; import "
                                          r"benchmarks.peers.cpu_peers$"):
        importlib.import_module("benchmarks.cpu_peers")
    assert "benchmarks.cpu_peers" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("benchmarks.never_a_script")


@pytest.mark.timeout(60)
def test_the_old_command_runs_as_a_real_command_line():
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernel_rates", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"})
    assert run.returncode == 0, run.stderr
    assert run.stderr == ("python -m benchmarks.kernel_rates is deprecated; run python -m "
                          "benchmarks.calibration.kernel_rates (same arguments)\n")
    assert run.stdout.startswith("usage: kernel_rates.py")


@pytest.mark.timeout(30)
def test_cpu_seconds_by_thread_name_counts_a_named_thread():
    def burn():
        end = time.thread_time() + 0.15
        while time.thread_time() < end:
            pass

    before = cpu_seconds_by_thread_name()
    readings = {}
    worker = threading.Thread(target=lambda: (burn(), readings.update(cpu_seconds_by_thread_name())),
                              name="harness-test-burner")
    worker.start()
    worker.join()
    assert "harness-test-burner" not in before
    assert readings["harness-test-burner"] >= 0.1  # 0.15 s of its own CPU, read in 10 ms ticks
    assert "MainThread" in readings and readings["MainThread"] >= before["MainThread"]
