"""Discrete-event simulator of RoundPipe steps (and of bound schedules), and a planner built on it.

It reads the same :class:`~lightning_roundpipe.schedule.plan.Plan` and dispatch order the engine runs,
times them with per-layer costs and a :class:`HardwareProfile`, and returns
:class:`~lightning_roundpipe.tracing.records.TraceRecord` timelines that ``timeline.py`` draws like
measured ones. See ``docs/simulator.md``.
"""

from .compare import ScheduleTable, compare_schedules, paper_table
from .hardware import HardwareProfile, available_hardware, load_hardware
from ..cost.memory import HostMemory, host_bytes, roundpipe_gpu_bytes
from ..cost.transformer import MODEL_PRESETS, ModelShape, get_model_shape, preset_costs, transformer_layer_costs
from ..planning.balanced import balanced_plan, make_plan
from ..planning.fit import PlanChoice, TrainingPlan, best_plan, longest_seq_len, plan_training
from .schedules import BOUND_SCHEDULES, bound_order, simulate_bound
from .simulate import SimConfig, SimResult, simulate_roundpipe

__all__ = [
    "BOUND_SCHEDULES", "HardwareProfile", "HostMemory", "MODEL_PRESETS", "ModelShape", "PlanChoice",
    "ScheduleTable", "SimConfig", "SimResult", "TrainingPlan", "available_hardware", "balanced_plan",
    "best_plan", "bound_order", "compare_schedules", "get_model_shape", "host_bytes", "load_hardware",
    "longest_seq_len", "make_plan", "paper_table", "plan_training", "preset_costs", "roundpipe_gpu_bytes",
    "simulate_bound", "simulate_roundpipe", "transformer_layer_costs",
]
