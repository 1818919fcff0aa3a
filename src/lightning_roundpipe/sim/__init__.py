"""Discrete-event simulator of RoundPipe steps.

It reads the same :class:`~lightning_roundpipe.schedule.plan.Plan` and lowered task graph the
engine runs, times them with per-layer costs and a
:class:`~lightning_roundpipe.cost.hardware.HardwareProfile`, and returns
:class:`~lightning_roundpipe.tracing.records.TraceRecord` timelines that ``timeline.py`` draws like
measured ones. The planner built on it is :mod:`lightning_roundpipe.planning.capacity`; bound
schedules and the published runs are in :mod:`lightning_roundpipe.analysis`. See ``docs/simulator.md``.
"""

from .simulate import SimConfig, SimResult, simulate_roundpipe

__all__ = ["SimConfig", "SimResult", "simulate_roundpipe"]
