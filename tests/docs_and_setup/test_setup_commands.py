"""scripts/dev.py, behind `make run` / `make test` and .ci/run: which set-up steps it plans on a
fresh machine, when it reuses the environment, which torch it asks for, and that it hands back the
exit code of what it ran. Creating a real environment takes minutes, so these tests use a fake
one (a stamp file and a stand-in interpreter); .ci/run does the real thing on every CI run."""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_dev():
    spec = importlib.util.spec_from_file_location("dev_script", REPO / "scripts" / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dev = load_dev()


def fake_root(tmp_path: Path, pyproject: str = "[project]\nname = 'x'\n") -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "pyproject.toml").write_text(pyproject)
    return root


def fake_venv(venv: Path, script: str = "#!/bin/sh\nexit 0\n") -> Path:
    """A directory that looks like a virtual environment whose `python` runs ``script``."""
    python = dev.venv_python(venv)
    python.parent.mkdir(parents=True)
    python.write_text(script)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python


def test_fresh_machine_creates_the_env_installs_torch_first_then_the_project(tmp_path):
    root = fake_root(tmp_path)
    venv = root / ".venv"
    steps = dev.setup_steps(root, venv, index_url=None, fresh=False)
    python = str(dev.venv_python(venv))
    assert [step.argv for step in steps] == [
        (sys.executable, "-m", "venv", str(venv)),
        (python, "-m", "pip", "install", "-q", "torch==2.13.0"),
        (python, "-m", "pip", "install", "-q", "-e", ".[dev]"),
    ]


def test_a_set_up_environment_is_reused_until_pyproject_changes(tmp_path):
    root = fake_root(tmp_path)
    venv = root / ".venv"
    fake_venv(venv)
    dev.write_stamp(venv, dev.setup_key(root, None))
    assert dev.setup_steps(root, venv, index_url=None, fresh=False) == []

    (root / "pyproject.toml").write_text("[project]\nname = 'x'\ndependencies = ['rich']\n")
    steps = dev.setup_steps(root, venv, index_url=None, fresh=False)
    assert [step.argv[3:] for step in steps] == [("install", "-q", "torch==2.13.0"),
                                                ("install", "-q", "-e", ".[dev]")]


def test_fresh_sets_up_again_and_an_interrupted_set_up_is_redone(tmp_path):
    root = fake_root(tmp_path)
    venv = root / ".venv"
    fake_venv(venv)
    dev.write_stamp(venv, dev.setup_key(root, None))
    assert len(dev.setup_steps(root, venv, index_url=None, fresh=True)) == 3
    (venv / dev.STAMP_NAME).write_text("{not json")  # a set-up killed half-way leaves no valid stamp
    assert len(dev.setup_steps(root, venv, index_url=None, fresh=False)) == 2


def test_torch_index_url_is_passed_to_pip_and_changes_the_stamp(tmp_path):
    root = fake_root(tmp_path)
    cpu = "https://download.pytorch.org/whl/cpu"
    assert dev.torch_install_args(cpu) == ["install", "-q", "torch==2.13.0", "--index-url", cpu]
    assert dev.torch_install_args(None) == ["install", "-q", "torch==2.13.0"]
    assert dev.setup_key(root, cpu) != dev.setup_key(root, None)


def test_gpu_detection_reads_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert dev.has_nvidia_gpu() is False  # no nvidia-smi at all
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    assert dev.has_nvidia_gpu() is True
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver.'\nexit 9\n")
    assert dev.has_nvidia_gpu() is False


def test_the_commands_run_with_the_environments_interpreter(tmp_path):
    venv = tmp_path / ".venv"
    python = str(dev.venv_python(venv))
    assert dev.command_argv(venv, "test", []) == [python, "-m", "pytest", "-q", "tests"]
    assert dev.command_argv(venv, "test", ["-k", "parity"]) == [python, "-m", "pytest", "-q", "tests", "-k", "parity"]
    assert dev.command_argv(venv, "run", ["experiment=tiny"]) == [python, "examples/finetune.py", "experiment=tiny"]
    assert dev.command_argv(venv, "docs", []) == [python, "-m", "mkdocs", "build", "--strict"]


def test_exit_code_of_the_tests_is_handed_back_and_nothing_is_installed_when_set_up(tmp_path):
    venv = tmp_path / "env"
    record = tmp_path / "argv.txt"
    fake_venv(venv, f'#!/bin/sh\necho "$@" > {record}\nexit 3\n')
    dev.write_stamp(venv, dev.setup_key(dev.ROOT, None))
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "dev.py"), "--venv", str(venv), "test", "-x"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert record.read_text().split() == ["-m", "pytest", "-q", "tests", "-x"]
    assert "[dev]" not in done.stdout  # no set-up step ran


def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path):
    venv = tmp_path / "missing-env"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "dev.py"), "--dry-run", "--venv", str(venv), "run", "experiment=tiny"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split("    #")[0] for line in lines] == [
        f"would run: {sys.executable} -m venv {venv}",
        f"would run: {dev.venv_python(venv)} -m pip install -q torch==2.13.0",
        f"would run: {dev.venv_python(venv)} -m pip install -q -e .[dev]",
        f"would run: {dev.venv_python(venv)} -m compileall -q src tests benchmarks scripts",
        f"would run: {dev.venv_python(venv)} examples/finetune.py experiment=tiny",
    ]
    assert not venv.exists()


def test_make_targets_and_ci_call_the_script():
    makefile = (REPO / "Makefile").read_text()
    for target in ("run", "test", "docs"):
        recipe = makefile.split(f"\n{target}:\n", 1)[1].splitlines()[0]
        assert recipe == f"\t$(PYTHON) scripts/dev.py $(DEV_FLAGS) {target} $(ARGS)"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == "exec python3 scripts/dev.py --fresh --venv .ci-venv test"
    assert os.access(REPO / ".ci" / "run", os.X_OK)
