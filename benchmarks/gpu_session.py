"""Lives in benchmarks/validation/gpu_session.py; this module gives it the short name `python -m benchmarks.gpu_session`
as every validation script has one."""
import pathlib
import sys

if __package__ in (None, ""):  # run as a file (python benchmarks/NAME.py): the repository root holds benchmarks/
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.validation.gpu_session import *  # noqa: E402,F401,F403  (re-exported for importers of the short name)
from benchmarks.validation.gpu_session import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
