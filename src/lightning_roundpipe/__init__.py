"""lightning-roundpipe: the RoundPipe schedule as a PyTorch Lightning strategy (engine usable alone)."""

from .options import (EngineOptions, OptionError, PartitionConfig, RuntimeOptions, StrategyOptions, TransferConfig,
                      register_configs)
from .engine import PipelineEngine
from .planning.cuts import simple_plan
from .schedule.plan import Plan, PlanError, dispatch
from .workers import CpuWorkerPool, PipelineError, PipelineTimeout, WorkerError, WorkerOutOfMemoryError, make_pool

__all__ = [
    "CpuWorkerPool",
    "EngineOptions",
    "OptionError",
    "PartitionConfig",
    "PipelineEngine",
    "PipelineError",
    "PipelineTimeout",
    "Plan",
    "PlanError",
    "WorkerError",
    "WorkerOutOfMemoryError",
    "dispatch",
    "make_pool",
    "simple_plan",
    "StrategyOptions",
    "TransferConfig",
]

from .lightning.strategy import RoundPipeStrategy, register as _register  # noqa: E402
from .runtime import RoundPipeRuntime  # noqa: E402

_register()
register_configs()
__all__ += ["RoundPipeRuntime", "RoundPipeStrategy", "RuntimeOptions"]
