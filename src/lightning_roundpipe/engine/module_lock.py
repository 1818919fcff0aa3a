"""The lock of the layers that share one module object, taken for each call of one of them, bounded.

``functional_call`` swaps a module's tensors for the call's duration, so one module object never
runs on two workers at once (see ``engine._shared_module_locks``). A call can wait for another
as long as a layer runs: the wait is bounded by the pool's timeout (compile seconds excluded), and
its error names the layer waiting and the layer call holding the module.
"""

from __future__ import annotations

import threading
from typing import Callable

from ..host.compile_clock import wait_excluding_compiles
from ..errors import PipelineTimeout


class ModuleLock:
    """A mutex over the layers ``layers`` (indices), which share a module object."""

    __slots__ = ("layers", "_lock", "_holder")

    def __init__(self, layers) -> None:
        self.layers = tuple(layers)
        self._lock = threading.Lock()
        self._holder: tuple | None = None  # (thread, layer, microbatch) of the call inside

    def acquire(self, timeout: float, layer: int, microbatch: int, task_of: Callable[[threading.Thread], str]) -> None:
        """Take the lock for ``layer`` on ``microbatch`` within ``timeout`` seconds, or raise naming who holds
        it."""
        if not wait_excluding_compiles(lambda left: self._lock.acquire(timeout=left), timeout):
            holder = self._holder
            held = ("another call" if holder is None else
                    f"layer {holder[1]}, microbatch {holder[2]} ({task_of(holder[0])})")
            shared = f" (shared by layers {', '.join(map(str, self.layers))})" if len(self.layers) > 1 else ""
            raise PipelineTimeout(
                f"layer {layer}, microbatch {microbatch} ({task_of(threading.current_thread())}) timed out after "
                f"{timeout:g}s waiting for its module{shared}, which {held} is running: one module object runs one "
                "call at a time, and that call did not return (a hung layer?)")
        self._holder = (threading.current_thread(), layer, microbatch)

    def release(self) -> None:
        """Let the next caller in."""
        self._holder = None
        self._lock.release()
