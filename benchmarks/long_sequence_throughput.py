"""Moved to benchmarks/figures/long_sequence_throughput.py; this module keeps `python -m benchmarks.long_sequence_throughput` and old imports working."""
import pathlib
import sys

if __package__ in (None, ""):  # run as a file (python benchmarks/NAME.py): the repository root holds benchmarks/
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.figures.long_sequence_throughput import *  # noqa: E402,F401,F403  (re-exported for importers of the old name)
from benchmarks.figures.long_sequence_throughput import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
