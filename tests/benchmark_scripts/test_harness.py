"""The benchmarks' shared harness and layout: common flags, JSON naming its producer, one index of
every script, and every old command name still running the moved script."""

import importlib
import json
import re
import threading
import time
from pathlib import Path

import pytest

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


def old_command_names():
    """The top-level modules that keep a moved script's ``python -m benchmarks.NAME`` working (every
    top-level module but the package's own and the harness). Scripts added since have no such name."""
    return sorted(p for p in BENCHMARKS.glob("*.py") if p.stem not in ("__init__", "harness"))


def test_the_old_command_names_are_kept():
    assert len(old_command_names()) >= 36  # the names the scripts had before they moved into folders


@pytest.mark.parametrize("shim", old_command_names(), ids=lambda p: p.stem)
def test_the_old_command_name_runs_the_moved_script(shim):
    moved = re.search(r"benchmarks/(\w+)/(\w+)\.py", shim.read_text().splitlines()[0])
    assert moved and moved.group(2) == shim.stem, f"{shim.name} names no script it runs"
    assert (BENCHMARKS / moved.group(1) / shim.name).exists(), f"python -m benchmarks.{shim.stem} points to a gone script"
    old = importlib.import_module(f"benchmarks.{shim.stem}")
    assert old.main is importlib.import_module(f"benchmarks.{moved.group(1)}.{shim.stem}").main


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
