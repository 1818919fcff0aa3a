"""Alias of benchmarks/figures/moe_expert_paths.py: `python -m benchmarks.moe_expert_paths` runs it too."""
import pathlib
import sys

if __package__ in (None, ""):  # run as a file (python benchmarks/NAME.py): the repository root holds benchmarks/
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.figures.moe_expert_paths import *  # noqa: E402,F401,F403  (re-exported for importers of the name)
from benchmarks.figures.moe_expert_paths import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
