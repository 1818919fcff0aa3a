"""Worker backends by name: the library's own ("cpu", "cuda") and those other packages register.

A package adds a backend with ``register_backend(name, pool_class)`` or, without being imported, with an
entry point in the group ``lightning_roundpipe.backends`` (``name = "module:PoolClass"``), loaded the first
time that name is asked for. The lab registers its fake drivers ("fake_cuda", "emulated") both ways, so
the library never imports it (docs/design.md, "The library and the lab").
"""

from __future__ import annotations

import threading
from importlib.metadata import entry_points

from .cpu import CpuWorkerPool
from .pool import WorkerPool

BUILT_IN = ("cpu", "cuda")
ENTRY_POINT_GROUP = "lightning_roundpipe.backends"
LAB_BACKENDS = ("fake_cuda", "emulated")  # named in the error for an unknown backend only


class BackendRegistry:
    """Pool classes by backend name: the built-in ones, those registered, and the entry points of ``group``."""

    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self.group = group
        self._classes: dict[str, type[WorkerPool]] = {}
        self._lock = threading.Lock()

    def register(self, name: str, pool_class: type[WorkerPool]) -> None:
        """Make ``backend=name`` build ``pool_class`` (a ``WorkerPool`` subclass). Registering the same class
        again is a no-op; another class under a taken name is an error."""
        if not (isinstance(pool_class, type) and issubclass(pool_class, WorkerPool)):
            raise TypeError(f"register_backend({name!r}, ...) needs a WorkerPool subclass, got {pool_class!r}")
        if name in BUILT_IN:
            raise ValueError(f"worker backend {name!r} is built into lightning_roundpipe and cannot be replaced")
        with self._lock:
            taken = self._classes.get(name)
            if taken is not None and taken is not pool_class:
                raise ValueError(f"worker backend {name!r} is registered already, as "
                                 f"{taken.__module__}.{taken.__qualname__}")
            self._classes[name] = pool_class

    def advertised(self) -> dict:
        """The installed packages' entry points of the group, by name (none is loaded)."""
        return {ep.name: ep for ep in entry_points(group=self.group)}

    def known(self) -> tuple[str, ...]:
        """Every name ``pool_class`` accepts now: built in, registered, or advertised by an entry point."""
        with self._lock:
            registered = set(self._classes)
        return BUILT_IN + tuple(sorted((registered | set(self.advertised())) - set(BUILT_IN)))

    def pool_class(self, backend: str) -> type[WorkerPool]:
        """The pool class of a backend name; its class attributes say what the backend is (see ``WorkerPool``)."""
        if backend == "cpu":
            return CpuWorkerPool
        if backend == "cuda":
            from .cuda import CudaWorkerPool  # torch.cuda's stream backend, imported when asked for

            return CudaWorkerPool
        with self._lock:
            found = self._classes.get(backend)
        if found is not None:
            return found
        entry = self.advertised().get(backend)
        if entry is not None:
            self.register(backend, entry.load())  # the package's own module, loaded on first use of its name
            return self._classes[backend]
        known = self.known()
        lab = "" if set(LAB_BACKENDS) <= set(known) else (
            f"; the lab's fake drivers ({', '.join(repr(n) for n in LAB_BACKENDS)}) come with this repository's second "
            "package, roundpipe_lab: install the repository (pip install -e .) or `import roundpipe_lab` first")
        raise ValueError(f"unknown worker backend {backend!r}: use one of {', '.join(known)}{lab}")


REGISTRY = BackendRegistry()
"""The process's registry: ``make_pool`` and the runtime read it."""


def register_backend(name: str, pool_class: type[WorkerPool]) -> None:
    """Make ``backend=name`` build ``pool_class`` everywhere in this process (``BackendRegistry.register``)."""
    REGISTRY.register(name, pool_class)


def known_backends() -> tuple[str, ...]:
    """Every backend name this process accepts now (``BackendRegistry.known``)."""
    return REGISTRY.known()


def backend_class(backend: str) -> type[WorkerPool]:
    """The pool class of a backend name (``BackendRegistry.pool_class``)."""
    return REGISTRY.pool_class(backend)
