"""Studies above the simulator and the planner: bound-schedule baselines (``bound_schedules.py``),
the schedule comparison (``compare.py``), the reproduction of published runs (``workload.py``,
``own_engine.py``, ``scaling.py``), the reference's precisions (``precision.py``), the split check's price
(``split_check.py``) and the ``python -m roundpipe_lab.sim`` commands (``cli.py``).

The library imports nothing of it (tests/docs_and_setup/test_library_imports_no_lab.py).
"""
