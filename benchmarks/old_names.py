"""The top-level command names (``python -m benchmarks.cpu_peers``) that README.md, docs/ or this folder's
README once showed, before the scripts moved into peers/, calibration/, validation/ and figures/.

A user may have copied one, so each still runs its script, after a deprecation message on stderr. Names
never documented are gone, and so is the file form (``python benchmarks/NAME.py``): keeping it takes a
file per name. Only ``python -m`` is served; importing an old name fails with the new one. Installed by
``benchmarks/__init__.py``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

# old name -> the module under benchmarks/ that runs now
MOVED = {
    "cpu_peers": "peers.cpu_peers",
    "gpu_bench": "peers.gpu_bench",
    "out_of_box": "peers.out_of_box",
    "dispatch_cost": "calibration.dispatch_cost",
    "host_accumulate_cost": "calibration.host_accumulate_cost",
    "host_rates": "calibration.host_rates",
    "kernel_rates": "calibration.kernel_rates",
    "launch_budget": "calibration.launch_budget",
    "emulated_gpus": "validation.emulated_gpus",
    "memory_sweep": "validation.memory_sweep",
    "published_gpu": "validation.published_gpu",
    "sim_validation": "validation.sim_validation",
    "longest_sequences": "figures.longest_sequences",
    "moe_grouped_experts": "figures.moe_grouped_experts",
    "moe_presets": "figures.moe_presets",
    "own_engine_reference": "figures.own_engine_reference",
    "partition_transfer": "figures.partition_transfer",
    "quick_size_gap": "figures.quick_size_gap",
    "scaling_plot": "figures.scaling_plot",
}

# old name of a one-off investigation that was deleted (issue 45) -> where its results are kept
REMOVED = {
    "correctness_figures": "benchmarks/README.md, 'What the removed investigations found'",
    "join_before_hooks_cost": "benchmarks/README.md, 'What the removed investigations found'",
}


def deprecation(old: str) -> str:
    """The line printed to stderr when ``python -m benchmarks.<old>`` runs."""
    if old in REMOVED:
        return f"benchmarks.{old} was a one-off investigation and has been removed; its results: {REMOVED[old]}"
    return f"python -m benchmarks.{old} is deprecated; run python -m benchmarks.{MOVED[old]} (same arguments)"


class OldNameLoader(importlib.abc.Loader):
    """Gives runpy (``python -m``) a few lines that print the deprecation and run the moved script."""

    def __init__(self, old: str):
        self.old = old

    def get_code(self, fullname: str):
        lines = ["import runpy, sys", f"print({deprecation(self.old)!r}, file=sys.stderr)"]
        if self.old in REMOVED:
            lines.append("raise SystemExit(2)")
        else:  # run_name passes __mp_main__ through, so a spawned child never reruns main()
            lines.append(f"runpy.run_module('benchmarks.{MOVED[self.old]}', run_name=__name__, alter_sys=True)")
        return compile("\n".join(lines), f"<old command name benchmarks.{self.old}>", "exec")

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        message = deprecation(self.old) if self.old in REMOVED else (
            f"benchmarks.{self.old} is only an old command name; import benchmarks.{MOVED[self.old]}")
        raise ImportError(message, name=module.__name__)


class OldNameFinder(importlib.abc.MetaPathFinder):
    """Finds ``benchmarks.<old name>`` after every real module has been looked for."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package != "benchmarks" or (old not in MOVED and old not in REMOVED):
            return None
        return importlib.util.spec_from_loader(fullname, OldNameLoader(old))


def install() -> None:
    """Put the finder last on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, OldNameFinder) for finder in sys.meta_path):
        sys.meta_path.append(OldNameFinder())
