"""Measuring what a worker's tasks allocate, and the cap that makes the CPU backend a small GPU.

``AllocationTally``, a ``TorchDispatchMode``, charges every storage a task creates to its worker's
``DeviceMemory`` ledger (``pool.py``) until the storage dies; over ``cap_bytes`` a task fails with
``WorkerOutOfMemoryError``. What the tally sees and misses: docs/design.md, design notes,
``workers/device_memory.py``.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import PipelineError, WorkerError
from .completions import TaskLabel

# ``DeviceMemory`` (pool.py) is named only in annotations: pool.py imports this module.

CAP_ADVICE = ("fit it by splitting each batch into more microbatches (fewer tokens each), keeping "
              "recompute='always', setting partition.memory_budget_bytes so the partitioner cuts "
              "smaller stages, or raising cpu_memory_cap_bytes")


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class WorkerOutOfMemoryError(WorkerError, MemoryError):
    """A task would take its worker over the per-worker memory cap (``cpu_memory_cap_bytes``).

    A ``WorkerError`` (a task failed on a worker; ``label`` is the task, ``original`` the
    error itself). Attributes: ``worker``, ``stage``, ``microbatch``, ``kind`` (the task),
    ``requested_bytes`` (the allocation that did not fit), ``held_bytes`` (what the worker held
    before it, weights included), ``weight_bytes`` and ``cap_bytes``.
    """

    def __init__(self, label: TaskLabel, requested: int, held: int, weights: int, cap: int):
        self.label, self.original, self.worker_traceback = label, self, ""
        self.worker, self.stage, self.microbatch, self.kind = label.worker, label.stage, label.microbatch, label.kind
        self.requested_bytes, self.held_bytes, self.weight_bytes, self.cap_bytes = requested, held, weights, cap
        mb = f", microbatch {label.microbatch}" if label.microbatch >= 0 else ""
        PipelineError.__init__(self, 
            f"worker {label.worker} is out of memory in the {label.kind} task of stage {label.stage or '?'}{mb}: "
            f"it asked for {requested} bytes ({_mb(requested)}) while holding {held} bytes ({_mb(held)}; "
            f"weights {_mb(weights)}), over its cap of {cap} bytes ({_mb(cap)}); {CAP_ADVICE}"
        )


class AllocationTally(TorchDispatchMode):
    """Counts, in ``memory``, the new storages of every operator run while the mode is active.

    One instance per lane thread; ``label`` is the task that lane runs (for the cap's error).
    """

    def __init__(self, memory: DeviceMemory) -> None:
        super().__init__()
        self.memory = memory
        self.label: TaskLabel | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [s for s in map(_storage, pytree.tree_leaves(out)) if s is not None]
        if outputs:
            inputs = {s.data_ptr() for s in map(_storage, pytree.tree_leaves((args, kwargs))) if s is not None}
            try:
                for s in outputs:
                    if s.data_ptr() not in inputs:  # views and in-place results reuse an input's storage
                        self.memory.hold(s, self.label)
            except (WorkerOutOfMemoryError, torch.OutOfMemoryError):  # the cap's, or the fake GPU allocator's
                del out, outputs, s  # the error's traceback must not keep the refused allocation alive
                raise
        return out


def _storage(t) -> torch.UntypedStorage | None:
    """The storage of a dense tensor (None for anything else: plain values, storage-less tensors)."""
    if not isinstance(t, torch.Tensor) or t.is_sparse or t.is_nested:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
