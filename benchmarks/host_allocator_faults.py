"""Moved to benchmarks/figures/host_allocator_faults.py; this module keeps `python -m benchmarks.host_allocator_faults` and old imports working."""
import pathlib
import sys

if __package__ in (None, ""):  # run as a file (python benchmarks/NAME.py): the repository root holds benchmarks/
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.figures.host_allocator_faults import *  # noqa: E402,F401,F403  (re-exported for importers of the old name)
from benchmarks.figures.host_allocator_faults import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
