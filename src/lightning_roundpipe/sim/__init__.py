"""Discrete-event simulator of RoundPipe steps (and of bound schedules), and a planner built on it.

It reads the same :class:`~lightning_roundpipe.schedule.plan.Plan` and dispatch order the engine runs,
times them with per-layer costs and a :class:`HardwareProfile`, and returns
:class:`~lightning_roundpipe.tracing.records.TraceRecord` timelines that ``timeline.py`` draws like
measured ones. See ``docs/simulator.md``.
"""

from importlib import import_module

# Each public name and the module that defines it. They are imported on first use (PEP 562
# ``__getattr__``): the cost model reads ``sim.hardware`` and ``sim.physical``, and this package's
# facade reads the cost model, so importing everything here would make the two packages import
# each other half-initialised.
_DEFINED_IN = {
    "ScheduleTable": ".compare", "compare_schedules": ".compare", "paper_table": ".compare",
    "HardwareProfile": ".hardware", "available_hardware": ".hardware", "load_hardware": ".hardware",
    "HostMemory": "..cost.memory", "host_bytes": "..cost.memory", "roundpipe_gpu_bytes": "..cost.memory",
    "MODEL_PRESETS": "..cost.transformer", "ModelShape": "..cost.transformer", "get_model_shape": "..cost.transformer",
    "preset_costs": "..cost.transformer", "transformer_layer_costs": "..cost.transformer",
    "balanced_plan": "..planning.balanced", "make_plan": "..planning.balanced",
    "PlanChoice": "..planning.fit", "TrainingPlan": "..planning.fit", "best_plan": "..planning.fit",
    "longest_seq_len": "..planning.fit", "plan_training": "..planning.fit",
    "BOUND_SCHEDULES": ".schedules", "bound_order": ".schedules", "simulate_bound": ".schedules",
    "SimConfig": ".simulate", "SimResult": ".simulate", "simulate_roundpipe": ".simulate",
}


def __getattr__(name: str):
    if name not in _DEFINED_IN:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_DEFINED_IN[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_DEFINED_IN))


__all__ = [
    "BOUND_SCHEDULES", "HardwareProfile", "HostMemory", "MODEL_PRESETS", "ModelShape", "PlanChoice",
    "ScheduleTable", "SimConfig", "SimResult", "TrainingPlan", "available_hardware", "balanced_plan",
    "best_plan", "bound_order", "compare_schedules", "get_model_shape", "host_bytes", "load_hardware",
    "longest_seq_len", "make_plan", "paper_table", "plan_training", "preset_costs", "roundpipe_gpu_bytes",
    "simulate_bound", "simulate_roundpipe", "transformer_layer_costs",
]
