"""The lab's worker backends, registered with the library by name ("fake_cuda", "emulated").

pyproject.toml advertises the same classes as ``lightning_roundpipe.backends`` entry points, so an
installed checkout runs ``backend="fake_cuda"`` without importing the lab; ``register_lab_backends``
does it where the entry points are not installed (a source tree on ``sys.path``).
"""

from __future__ import annotations

from lightning_roundpipe.workers import register_backend

from .fake_cuda.emulated import EmulatedWorkerPool
from .fake_cuda.pool import FakeCudaWorkerPool

LAB_BACKENDS = {"fake_cuda": FakeCudaWorkerPool, "emulated": EmulatedWorkerPool}


def register_lab_backends() -> None:
    """Make ``backend="fake_cuda"`` and ``backend="emulated"`` known to ``lightning_roundpipe.workers.make_pool``."""
    for name, pool_class in LAB_BACKENDS.items():
        register_backend(name, pool_class)
