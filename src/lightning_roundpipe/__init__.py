"""lightning-roundpipe: the RoundPipe schedule as a PyTorch Lightning strategy (engine usable alone)."""

from .engine import EngineOptions, PipelineEngine
from .schedule.plan import Plan, PlanError, dispatch, simple_plan
from .workers import CpuWorkerPool, PipelineError, PipelineTimeout, WorkerError, make_pool

__all__ = [
    "CpuWorkerPool",
    "EngineOptions",
    "PipelineEngine",
    "PipelineError",
    "PipelineTimeout",
    "Plan",
    "PlanError",
    "WorkerError",
    "dispatch",
    "make_pool",
    "simple_plan",
]

from .lightning.strategy import RoundPipeStrategy, register as _register  # noqa: E402
from .runtime import RoundPipeRuntime, RuntimeOptions  # noqa: E402

_register()
__all__ += ["RoundPipeRuntime", "RoundPipeStrategy", "RuntimeOptions"]
