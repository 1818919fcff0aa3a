"""The built wheel works on its own: installed into a fresh environment, run from another folder."""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(REPO)], check=True, cwd=out, timeout=100)
    (built,) = out.glob("lightning_roundpipe-*.whl")
    return built


def test_wheel_ships_the_hardware_profiles(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for profile in ("rtx4090", "a100", "h100", "cpu2"):
        assert f"lightning_roundpipe/cost/profiles/{profile}.yaml" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "conf/")) for n in names)


def test_wheel_ships_the_lab_beside_the_library_with_its_backends_by_name(wheel):
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert "roundpipe_lab/fake_cuda/pool.py" in names and "roundpipe_lab/analysis/cli.py" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = archive.read(entry_points).decode()
    assert ("[lightning_roundpipe.backends]\nemulated = roundpipe_lab.fake_cuda.emulated:EmulatedWorkerPool\n"
            "fake_cuda = roundpipe_lab.fake_cuda.pool:FakeCudaWorkerPool\n") in text, text


@pytest.mark.slow
@pytest.mark.timeout(400)  # the planning command itself searches partitions for about a minute on a loaded CPU
def test_installed_wheel_plans_from_another_folder(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    # Reuse this environment's packages (torch, lightning, ...) offline: a plain path entry, which does
    # not run that environment's .pth files, so a development checkout installed there stays invisible.
    (site / "reuse_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # --ignore-installed: the reused environment may list a development install of the same version.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--ignore-installed", "-q", str(wheel)], check=True, timeout=100, env=env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    found = subprocess.run([str(python), "-c", "import lightning_roundpipe as m; print(m.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=100)
    assert found.returncode == 0, found.stderr[-3000:]
    where = found.stdout.strip()
    assert where.startswith(str(site)), where  # the wheel's copy, not the checkout
    run = subprocess.run([str(python), "-m", "lightning_roundpipe.plan", "--model", "qwen3-8b", "--hardware",
                          "rtx4090"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "rtx4090" in run.stdout and "qwen3-8b" in run.stdout.lower()
