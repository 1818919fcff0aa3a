"""The environment of a GPU session: ``check_environment``'s machine plus the driver, the library versions and
the memlock limit (pinned host memory counts against it)."""

from __future__ import annotations

import importlib.metadata
import resource
import subprocess

from .context import Ctx
from .environment import check_environment


def driver_version() -> str | None:
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout.strip().splitlines()[0] if run.returncode == 0 and run.stdout.strip() else None


def versions() -> dict:
    out = {}
    for package in ("torch", "lightning", "transformers", "peft", "triton"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def memlock_limit() -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = resource.RLIM_INFINITY
    return dict(soft_bytes=None if soft == unlimited else soft, hard_bytes=None if hard == unlimited else hard,
                unlimited=soft == unlimited)


def check_session_environment(ctx: Ctx) -> tuple[str, str, dict]:
    verdict, summary, info = check_environment(ctx)
    info.update(driver=driver_version() if ctx.cuda else None, versions=versions(), memlock=memlock_limit())
    lock = info["memlock"]
    limit = "unlimited" if lock["unlimited"] else f"{(lock['soft_bytes'] or 0) / 2**30:.1f} GiB"
    summary += f"; driver {info['driver']}; torch {info['versions']['torch']}, " \
               f"transformers {info['versions']['transformers']}; memlock {limit}"
    return verdict, summary, info
