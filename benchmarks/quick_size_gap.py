"""Lives in benchmarks/figures/quick_size_gap.py; this module runs it as `python -m benchmarks.quick_size_gap`, like every script of benchmarks/."""
import pathlib
import sys

if __package__ in (None, ""):  # run as a file (python benchmarks/NAME.py): the repository root holds benchmarks/
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.figures.quick_size_gap import *  # noqa: E402,F401,F403  (re-exported for importers of this name)
from benchmarks.figures.quick_size_gap import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
