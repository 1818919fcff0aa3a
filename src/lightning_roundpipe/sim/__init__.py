"""Discrete-event simulator of RoundPipe steps.

It reads the same ``Plan`` and lowered task graph the
engine runs, times them with per-layer costs and a
``HardwareProfile``, and returns
``TraceRecord`` timelines that ``timeline.py`` draws like
measured ones. The planner built on it is ``lightning_roundpipe.planning.capacity``; bound
schedules and the published runs are in the lab (``roundpipe_lab.analysis``). See ``docs/simulator.md``.
"""

from .simulate import SimConfig, SimResult, simulate_roundpipe

__all__ = ["SimConfig", "SimResult", "simulate_roundpipe"]
