"""What each worker holds "on its device", measured, and the cap that makes the CPU backend a small GPU.

A ``DeviceMemory`` ledger per worker counts ``weight_bytes`` (stage weights uploaded and not yet
released, every backend) and, on the CPU backend with measuring on, ``tensor_bytes``: every
storage the worker's tasks create, tallied by a ``TorchDispatchMode`` (``AllocationTally``) and
taken off when the storage dies. ``peak_bytes`` is their largest sum; over ``cap_bytes`` a task
fails with ``WorkerOutOfMemoryError``. What the tally sees and misses: docs/design.md, design
notes, ``workers/device_memory.py``.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import PipelineError, WorkerError
from .completions import TaskLabel

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


class DeviceMemory:
    """One worker's ledger of device bytes: weights, tallied tensors, the peak, an optional cap."""

    def __init__(self, worker: int, cap_bytes: int | None = None) -> None:
        self.worker = worker
        self.cap_bytes = cap_bytes
        self._lock = threading.Lock()
        self.weight_bytes = 0
        self.tensor_bytes = 0
        self.peak_bytes = 0
        self.peak_weight_bytes = 0
        self.peak_task: TaskLabel | None = None  # the task that allocated the peak byte
        self._storages: dict[int, int] = {}  # id of a live storage -> its bytes

    @property
    def held_bytes(self) -> int:
        """Bytes the worker holds now: weights and tensors."""
        return self.weight_bytes + self.tensor_bytes

    def _over_cap(self, asked: int, before: int) -> bool:
        return self.cap_bytes is not None and asked > 0 and before + asked > self.cap_bytes

    def _error(self, label: TaskLabel | None, asked: int, before: int, weights_before: int):
        label = label or TaskLabel("unknown", worker=self.worker)
        return WorkerOutOfMemoryError(label, asked, before, weights_before, self.cap_bytes)

    def track_weights(self, delta: int, label: TaskLabel | None = None) -> None:
        """Weights uploaded (``delta > 0``) or released. Over the cap this raises, with the bytes
        counted (the stage's release takes them off again) but not taken as a peak."""
        with self._lock:
            before, weights_before = self.held_bytes, self.weight_bytes
            self.weight_bytes += delta
            over = self._over_cap(delta, before)
            if not over:
                self.peak_weight_bytes = max(self.peak_weight_bytes, self.weight_bytes)
                self._new_peak(label)
        if over:
            raise self._error(label, delta, before, weights_before)

    def hold(self, storage: torch.UntypedStorage, label: TaskLabel | None = None) -> None:
        """Count a storage a task created until it dies. One that would take the worker over the
        cap raises instead and is never counted: as on a GPU, the allocation did not happen (the
        tally drops the tensor as the error leaves the operator)."""
        nbytes = storage.nbytes()
        key = id(storage)
        if nbytes == 0:
            return
        with self._lock:
            if key in self._storages:
                return
            before, weights = self.held_bytes, self.weight_bytes
            if self._over_cap(nbytes, before):
                raise self._error(label, nbytes, before, weights)
            self._storages[key] = nbytes
            self.tensor_bytes += nbytes
            self._new_peak(label)
        weakref.finalize(storage, self._free, key)

    def _new_peak(self, label: TaskLabel | None) -> None:
        if self.held_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_task = self.held_bytes, label

    def _free(self, key: int) -> None:
        with self._lock:
            self.tensor_bytes -= self._storages.pop(key, 0)

    def reset_peak(self) -> None:
        """Start measuring the peaks again from what is held now."""
        with self._lock:
            self.peak_bytes, self.peak_task = self.held_bytes, None
            self.peak_weight_bytes = self.weight_bytes


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
