"""Studies above the simulator and the planner: bound-schedule baselines (``bound_schedules.py``),
the schedule comparison (``compare.py``), the reproduction of published runs (``workload.py``,
``own_engine.py``, ``scaling.py``) and the ``python -m lightning_roundpipe.sim`` commands (``cli.py``).

Nothing in the training path imports this package; only the simulator's command reaches it.
"""
