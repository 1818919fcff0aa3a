#!/usr/bin/env python3
"""Set up the project's own virtual environment on first use, then run the job, the tests or the docs.

    python3 scripts/dev.py run  [Hydra overrides...]   # the fine-tuning job (examples/finetune.py)
    python3 scripts/dev.py test [pytest arguments...]  # the tests: python -m pytest -q tests
    python3 scripts/dev.py docs [mkdocs arguments...]  # the user guide: mkdocs build --strict
    python3 scripts/dev.py --dry-run test              # say what would be done, do nothing

``make run`` and ``make test`` call this. Needs only Python 3.10+ (standard library) and the
repository. The first call creates ``.venv`` (``--venv`` or ``ROUNDPIPE_VENV`` choose another
place), installs torch first and then the project in editable mode with its ``dev`` extra; later
calls reuse it and install nothing unless ``pyproject.toml`` (or the torch choice) changed, which
a stamp file inside the environment records. ``--fresh`` deletes the environment first (CI).

Which torch: the project pins ``torch==2.13.0`` and installs it on its own, before the project,
so that pip takes the build this machine is set up for instead of resolving torch as a
dependency. On a machine with an NVIDIA GPU (``nvidia-smi -L`` lists one) that is PyPI's Linux
wheel, the usual CUDA build; the script checks afterwards that the installed torch has CUDA and
says what to do if not. Without a GPU, pip takes the CPU wheel where the machine offers one (a
local wheel directory or index in pip's configuration). ``TORCH_INDEX_URL`` overrides both, e.g.
``https://download.pytorch.org/whl/cpu`` on a CPU-only machine (avoids downloading the CUDA
build) or ``https://download.pytorch.org/whl/cu128`` for a specific CUDA version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
TORCH_SPEC = "torch==2.13.0"
EXTRAS = "dev"
STAMP_NAME = "roundpipe-setup.json"

COMMANDS = {
    "run": ["examples/finetune.py"],
    "test": ["-m", "pytest", "-q", "tests"],
    "docs": ["-m", "mkdocs", "build", "--strict"],
}


class Step(NamedTuple):
    """One thing the set-up does: a message for the user and the command it runs."""

    say: str
    argv: tuple[str, ...]


def venv_python(venv: Path) -> Path:
    """The interpreter inside a virtual environment."""
    if os.name == "nt":
        return venv / "Scripts" / "python.exe"
    return venv / "bin" / "python"


def has_nvidia_gpu() -> bool:
    """True when ``nvidia-smi -L`` lists at least one GPU."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listing.returncode == 0 and any(line.startswith("GPU ") for line in listing.stdout.splitlines())


# pip byte-compiles what it installs, and that stays: this machine and CI set PYTHONDONTWRITEBYTECODE=1,
# so a module pip did not compile is compiled again by every process that imports it. With --no-compile
# the suite's pytest time went from 670 s to 953 s in .ci/run (2026-12-06), for ~25 s saved in the build.
PIP_INSTALL = ("install", "-q")


def torch_install_args(index_url: str | None) -> list[str]:
    """pip arguments that install the pinned torch (from ``index_url`` when given)."""
    args = [*PIP_INSTALL, TORCH_SPEC]
    if index_url:
        args += ["--index-url", index_url]
    return args


def setup_key(root: Path, index_url: str | None) -> str:
    """What the installed environment depends on: when it changes, the next call installs again."""
    digest = hashlib.sha256()
    digest.update((root / "pyproject.toml").read_bytes())
    digest.update(f"{TORCH_SPEC}|{index_url or ''}|{EXTRAS}|{sys.version_info[:2]}".encode())
    return digest.hexdigest()


def read_stamp(venv: Path) -> str | None:
    """The key recorded by the last complete set-up of ``venv``; ``None`` if there was none."""
    try:
        return json.loads((venv / STAMP_NAME).read_text())["key"]
    except (OSError, ValueError, KeyError):
        return None


def write_stamp(venv: Path, key: str) -> None:
    (venv / STAMP_NAME).write_text(json.dumps({"key": key, "torch": TORCH_SPEC, "extras": EXTRAS}) + "\n")


def setup_steps(root: Path, venv: Path, index_url: str | None, fresh: bool) -> list[Step]:
    """The set-up commands still needed for ``venv`` (empty when it is ready and unchanged)."""
    python = str(venv_python(venv))
    steps: list[Step] = []
    exists = venv_python(venv).exists() and not fresh
    if not exists:
        steps.append(Step(f"creating {venv}", (sys.executable, "-m", "venv", str(venv))))
    if not exists or read_stamp(venv) != setup_key(root, index_url):
        steps.append(Step(f"installing {TORCH_SPEC} (first, so pip takes this machine's build)",
                          (python, "-m", "pip", *torch_install_args(index_url))))
        steps.append(Step(f"installing the project (editable) with its {EXTRAS} extra",
                          (python, "-m", "pip", *PIP_INSTALL, "-e", f".[{EXTRAS}]")))
    return steps


# pip byte-compiles the packages it installs but not an editable project's own files; with
# PYTHONDONTWRITEBYTECODE=1 (this machine, CI) every test process would compile them again.
COMPILED_FOLDERS = ("src", "tests", "benchmarks", "scripts")


def compile_argv(venv: Path) -> list[str]:
    """Byte-compile the project's own files once, after a set-up (``compileall`` writes the .pyc files
    whatever PYTHONDONTWRITEBYTECODE says)."""
    return [str(venv_python(venv)), "-m", "compileall", "-q", *COMPILED_FOLDERS]


def command_argv(venv: Path, command: str, extra: list[str]) -> list[str]:
    """The command the user asked for, run with the environment's interpreter."""
    return [str(venv_python(venv)), *COMMANDS[command], *extra]


def check_torch_matches_machine(venv: Path, gpu: bool) -> None:
    """On a GPU machine, say so loudly if pip installed a torch without CUDA."""
    if not gpu:
        return
    probe = subprocess.run(
        [str(venv_python(venv)), "-c", "import torch; print(torch.version.cuda or '')"],
        capture_output=True, text=True,
    )
    if probe.returncode == 0 and not probe.stdout.strip():
        print(
            "note: this machine has an NVIDIA GPU but the installed torch has no CUDA support "
            "(pip took a CPU build). Run again with TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 "
            "(or the CUDA version your driver supports) and --fresh.",
            file=sys.stderr,
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print what would be done and exit")
    parser.add_argument("--fresh", action="store_true", help="delete the environment and set it up again")
    parser.add_argument("--venv", default=os.environ.get("ROUNDPIPE_VENV", ".venv"),
                        help="where the environment lives, relative to the repository (default .venv)")
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the job, pytest or mkdocs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = parse_args(sys.argv[1:] if argv is None else argv)
    venv = (ROOT / options.venv).resolve()
    index_url = os.environ.get("TORCH_INDEX_URL") or None
    steps = setup_steps(ROOT, venv, index_url, options.fresh)
    final = command_argv(venv, options.command, options.args)
    if options.dry_run:
        if options.fresh and venv.exists():
            print(f"would delete {venv}")
        for step in steps:
            print(f"would run: {' '.join(step.argv)}    # {step.say}")
        if steps:
            print(f"would run: {' '.join(compile_argv(venv))}    # the project's own files, byte-compiled once")
        if not steps:
            print(f"{venv} is set up and unchanged: nothing to install")
        print(f"would run: {' '.join(final)}")
        return 0

    if options.fresh and venv.exists():
        print(f"[dev] deleting {venv}", flush=True)
        shutil.rmtree(venv)
    started = time.perf_counter()
    for step in steps:
        print(f"[dev] {step.say}", flush=True)
        done = subprocess.run(step.argv, cwd=ROOT)
        if done.returncode != 0:
            print(f"[dev] failed ({done.returncode}): {' '.join(step.argv)}", file=sys.stderr)
            return done.returncode
    if steps:
        print("[dev] byte-compiling the project's own files", flush=True)
        subprocess.run(compile_argv(venv), cwd=ROOT)  # a file that fails to compile fails in its test instead
        write_stamp(venv, setup_key(ROOT, index_url))
        check_torch_matches_machine(venv, has_nvidia_gpu())
        print(f"[dev] environment ready in {time.perf_counter() - started:.0f} s: {venv}", flush=True)
    try:
        return subprocess.run(final, cwd=ROOT).returncode
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
