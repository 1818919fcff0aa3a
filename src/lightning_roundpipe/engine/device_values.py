"""Device values of one call and who still reads them: the last reader drops the value.

An upload's or a compute's value lives on a worker's device; a worker holds a microbatch's
tensors only until every task that depends on them has run.
"""

from __future__ import annotations

import threading
from typing import Callable

from ..schedule.lowering import TaskGraph
from ..workers.completions import Completion


# Kinds that depend on computes without reading their values: a weight-gradient download reads
# the gradients the stage's computes accumulated on the device, and depends on every microbatch's
# compute only so that any one's failure fails it. Counted as readers, they would keep every
# microbatch's output on the device until the stage ends.
NOT_READING = ("wgrad",)


def device_readers(graph: TaskGraph) -> dict[int, int]:
    """Per upload or compute task of ``graph`` (its value is on the device), how many tasks read it."""
    out: dict[int, int] = {}
    for t in graph:
        if t.kind in NOT_READING:
            continue
        for d in t.deps:
            if graph.tasks[d].lane in ("upload", "compute"):
                out[d] = out.get(d, 0) + 1
    return out


class DeviceReaders:
    """Reference counts of a call's device values, over the call's task completions ``done``."""

    def __init__(self, graph: TaskGraph, done: dict[int, Completion]) -> None:
        self.done = done
        self._readers = device_readers(graph)
        self._lock = threading.Lock()

    def __contains__(self, task_id: int) -> bool:
        return task_id in self._readers

    def add_backward(self, graph: TaskGraph) -> None:
        """A second backward of the call: its backward tasks read the forward's values afresh."""
        with self._lock:
            self._readers.update({d: n for d, n in device_readers(graph).items() if graph.tasks[d].phase == "backward"})

    def reading(self, fn: Callable, deps) -> Callable:
        """``fn``, then drop the values of those of ``deps`` on a device that no other dependant will read."""
        device_deps = [d for d in deps if d in self._readers]
        if not device_deps:
            return fn

        def run():
            try:
                return fn()
            finally:
                with self._lock:
                    for d in device_deps:
                        self._readers[d] -= 1
                        if self._readers[d] == 0:
                            self.done[d].drop_value()

        return run

    def drop_all(self) -> None:
        """After a failed call: forget every device value (their readers will not run)."""
        with self._lock:
            for d in self._readers:
                if d in self.done:
                    self.done[d].drop_value()
