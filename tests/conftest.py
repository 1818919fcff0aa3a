"""The lab's fake drivers by name for every test: importing ``roundpipe_lab`` registers ``backend="fake_cuda"``
and ``backend="emulated"`` (an installed checkout also finds them through pyproject's entry points; a
source tree first on ``sys.path``, as pytest's ``pythonpath`` puts it, may be newer than what is installed)."""

import roundpipe_lab  # noqa: F401
