"""Every exception class of the package is defined in ``errors.py`` (issue 45: one errors module with the root error).

The classes are found by importing every module of the package; the one that stays in its own module is
listed with the reason. ``errors.py`` is a leaf: it imports nothing of the package.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import lightning_roundpipe
from lightning_roundpipe import errors

pytestmark = pytest.mark.timeout(60)

# Its message is built from workers/device_memory.py's memory-cap advice (CAP_ADVICE, _mb).
STAYS = {"lightning_roundpipe.workers.device_memory.WorkerOutOfMemoryError"}


def package_exception_classes() -> dict[str, type]:
    found = {}
    for info in pkgutil.walk_packages(lightning_roundpipe.__path__, "lightning_roundpipe."):
        if info.name.endswith("__main__"):
            continue
        for value in vars(importlib.import_module(info.name)).values():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__.startswith("lightning_roundpipe"):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


def test_every_exception_class_is_defined_in_errors():
    found = package_exception_classes()
    assert set(STAYS) <= set(found)
    elsewhere = sorted(name for name in found if not name.startswith("lightning_roundpipe.errors.") and name not in STAYS)
    assert elsewhere == []
    assert len(found) == 31  # 30 in errors.py, and WorkerOutOfMemoryError


def test_each_derives_from_the_root_or_a_builtin_as_before():
    bases = {name: tuple(b.__name__ for b in cls.__bases__) for name, cls in package_exception_classes().items()}
    short = {name.rsplit(".", 1)[1]: b for name, b in bases.items()}
    assert short == {
        "PipelineError": ("RuntimeError",), "UnsupportedWeightError": ("TypeError",),
        "HostTensorOnWorkerError": ("RuntimeError",), "WorkerError": ("PipelineError",),
        "PipelineTimeout": ("PipelineError", "TimeoutError"), "StepFailed": ("PipelineError",),
        "LayerStepSkipped": ("StepFailed",), "EarlyStopUnsupported": ("PipelineError",),
        "NodeSyncError": ("PipelineError",), "OptionError": ("ValueError",), "SplitInvarianceError": ("OptionError",),
        "PlanError": ("ValueError",), "MicrobatchError": ("ValueError",), "ForwardHookError": ("RuntimeError",),
        "UnseededDraw": ("RuntimeError",), "RecompileLimitError": ("RuntimeError",), "LayerCompileError": ("RuntimeError",),
        "CheckpointError": ("RuntimeError",), "CheckpointSpaceError": ("CheckpointError", "OSError"),
        "CheckpointIntegrityError": ("CheckpointError",), "PipelineTargetError": ("ValueError",),
        "UnsupportedModelError": ("ValueError",), "UnsupportedInputError": ("ValueError",),
        "HiddenStatesNotReturnedError": ("LookupError",), "LogitsNotComputedError": ("AttributeError",),
        "StackSetupError": ("ValueError",), "BlockChainError": ("ValueError",), "UnpipelinedCallWarning": ("UserWarning",),
        "FineTuneInputError": ("ValueError",), "SimulationError": ("RuntimeError",),
        "WorkerOutOfMemoryError": ("WorkerError", "MemoryError"),
    }


def test_the_old_import_paths_still_give_the_same_classes():
    from lightning_roundpipe.adapters.input_errors import UnsupportedInputError
    from lightning_roundpipe.lightning.checkpoint_errors import CheckpointSpaceError
    from lightning_roundpipe.options import OptionError
    from lightning_roundpipe.workers.completions import PipelineError, WorkerError
    assert (UnsupportedInputError, CheckpointSpaceError, OptionError, PipelineError, WorkerError) == (
        errors.UnsupportedInputError, errors.CheckpointSpaceError, errors.OptionError, errors.PipelineError, errors.WorkerError)
    assert lightning_roundpipe.PipelineError is errors.PipelineError


def test_errors_imports_nothing_of_the_package():
    tree = ast.parse(Path(errors.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [("." * n.level) + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert sorted(imported) == ["__future__", "errno"]
