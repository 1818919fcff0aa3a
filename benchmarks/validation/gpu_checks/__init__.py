"""The checks of ``gpu_validate``, one module per concern; each ``check_*`` takes a ``Ctx`` and returns
``(verdict, summary, details)``."""
