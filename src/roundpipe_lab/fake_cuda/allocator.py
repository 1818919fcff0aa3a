"""CUDA's caching allocator, as the fake driver models it: one cache of free blocks per allocation stream.

A ``FakeCachingAllocator`` stands for one fake GPU. A tensor a task creates on a stream is charged to
that stream's pool (upload or compute) and, once freed, its bytes stay *reserved* in that pool's
cache, reusable only by later allocations on the same stream. An allocation takes from its own
pool's cache, then from what no pool reserves; when both together are too little, the allocator
does what CUDA's does: it synchronizes, frees every pool's cached blocks (counted, as
``torch.cuda.memory_stats()["num_alloc_retries"]``) and tries again, else raises
``torch.OutOfMemoryError``. Its capacity is the GPU's memory less the CUDA context, cuBLAS
workspaces and allocator pages (``cost/device_overheads.py``), the overheads the budget deducts.
Not modelled (``docs/fake_cuda.md``): fragmentation, block splitting, expandable segments' pages.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch

from lightning_roundpipe.cost.device_overheads import device_reserved_bytes
from lightning_roundpipe.workers.completions import TaskLabel
from lightning_roundpipe.workers.device_memory import AllocationTally

BLOCK_BYTES = 512  # CUDA's allocator rounds every allocation up to a multiple of 512 bytes
MiB = 2**20


def _mib(n: float) -> str:
    return f"{n / MiB:.2f} MiB"


def fake_gpu_capacity_bytes(total_bytes: int, sm90: bool = False) -> int:
    """What the caching allocator of a GPU of ``total_bytes`` can reserve: the GPU less its CUDA context,
    cuBLAS workspaces and allocator pages (``device_reserved_bytes``), as the CUDA budget deducts them."""
    return max(0, int(total_bytes) - device_reserved_bytes(sm90=sm90))


class StreamPool:
    """One allocation stream's share of a fake GPU: bytes allocated, bytes reserved (allocated + cached)."""

    __slots__ = ("name", "allocated", "reserved", "peak_reserved")

    def __init__(self, name: str):
        self.name = name
        self.allocated = 0
        self.reserved = 0
        self.peak_reserved = 0

    @property
    def cached(self) -> int:
        """Free bytes this pool keeps for its own stream's next allocations."""
        return self.reserved - self.allocated


class FakeCachingAllocator:
    """One fake GPU's caching allocator (see the module doc). ``capacity_bytes`` None: no limit (the
    pools and their peaks are still measured). ``synchronize``: called before a retry frees the caches
    (the fake driver drops the ``record_stream`` holds whose streams have passed)."""

    def __init__(self, capacity_bytes: int | None, device: str = "fake GPU",
                 synchronize: Callable[[], object] | None = None):
        self.capacity_bytes = capacity_bytes
        self.device = device
        self._synchronize = synchronize
        self._lock = threading.Lock()
        self.pools: dict[str, StreamPool] = {}
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self._blocks: dict[int, tuple[StreamPool, int]] = {}  # id of a live storage -> (its pool, its bytes)

    def pool(self, name: str) -> StreamPool:
        """The pool of allocation stream ``name`` (made on first use)."""
        with self._lock:
            return self.pools.setdefault(name, StreamPool(name))

    @property
    def reserved(self) -> int:
        """Bytes every pool reserves now."""
        return sum(p.reserved for p in self.pools.values())

    @property
    def allocated(self) -> int:
        """Bytes of live tensors now."""
        return sum(p.allocated for p in self.pools.values())

    def _fits(self, pool: StreamPool, nbytes: int) -> bool:
        return self.capacity_bytes is None or nbytes <= pool.cached + self.capacity_bytes - self.reserved

    def allocate(self, storage: torch.UntypedStorage, pool: StreamPool, label: TaskLabel | None = None) -> None:
        """Charge ``storage`` to ``pool`` until it dies: from the pool's cache, then from free device
        memory, after one retry (every cache freed) if need be; else ``torch.OutOfMemoryError``."""
        key = id(storage)
        nbytes = -(-storage.nbytes() // BLOCK_BYTES) * BLOCK_BYTES
        if nbytes == 0:
            return
        with self._lock:
            if key in self._blocks:
                return
            fits = self._fits(pool, nbytes)
            if fits:
                self._take(storage, pool, nbytes)
        if not fits:
            if self._synchronize is not None:
                self._synchronize()  # outside the lock: blocks it lets go come back through ``_free``
            with self._lock:
                self.num_alloc_retries += 1
                for p in self.pools.values():
                    p.reserved = p.allocated
                if not self._fits(pool, nbytes):
                    self.num_ooms += 1
                    raise torch.OutOfMemoryError(self._oom_text(pool, nbytes, label))
                self._take(storage, pool, nbytes)
        weakref.finalize(storage, self._free, key)

    def _take(self, storage: torch.UntypedStorage, pool: StreamPool, nbytes: int) -> None:
        pool.reserved += max(0, nbytes - pool.cached)
        pool.allocated += nbytes
        self._blocks[id(storage)] = (pool, nbytes)
        pool.peak_reserved = max(pool.peak_reserved, pool.reserved)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def _free(self, key: int) -> None:
        """A storage died: its bytes stay reserved, cached for its own pool's stream."""
        with self._lock:
            pool, nbytes = self._blocks.pop(key, (None, 0))
            if pool is not None:
                pool.allocated -= nbytes

    def _oom_text(self, pool: StreamPool, nbytes: int, label: TaskLabel | None) -> str:
        free = self.capacity_bytes - self.reserved
        task = f" in task [{label}]" if label is not None else ""
        return (f"CUDA out of memory{task}. Tried to allocate {_mib(nbytes)} on the {pool.name} stream. {self.device} "
                f"has {_mib(self.capacity_bytes)} for tensors (its memory less context, workspaces and allocator "
                f"pages), of which {_mib(free)} is free. Of the reserved memory {_mib(self.allocated)} is allocated "
                f"and {_mib(self.reserved - self.allocated)} is reserved but unallocated, after "
                f"{self.num_alloc_retries} allocator retries (fake driver)")

    def empty_cache(self) -> None:
        """Free every pool's cached blocks (``torch.cuda.empty_cache``); not counted as a retry."""
        with self._lock:
            for p in self.pools.values():
                p.reserved = p.allocated

    def reset_peaks(self) -> None:
        """Start the peaks afresh from what is reserved and allocated now."""
        with self._lock:
            for p in self.pools.values():
                p.peak_reserved = p.reserved
            self.peak_reserved, self.peak_allocated = self.reserved, self.allocated

    def memory_stats(self) -> dict:
        """What ``device_memory_stats`` reports for a GPU, and the peak reserved bytes of each stream's pool."""
        with self._lock:
            return dict(allocated_peak_bytes=self.peak_allocated, reserved_peak_bytes=self.peak_reserved,
                        alloc_retries=self.num_alloc_retries, ooms=self.num_ooms,
                        reserved_peak_bytes_by_pool={p.name: p.peak_reserved for p in self.pools.values()})


class PoolTally(AllocationTally):
    """The tally of one stream's tasks: every new storage is allocated in that stream's pool."""

    def __init__(self, allocator: FakeCachingAllocator, pool: str):
        super().__init__(_PoolMemory(allocator, allocator.pool(pool)))

    def running(self, fn: Callable, label: TaskLabel) -> Callable:
        """``fn`` run with its allocations charged to this tally's pool (one task on the stream at a time)."""
        def run():
            self.label = label
            with self:
                return fn()

        return run


class _PoolMemory:
    """What ``AllocationTally`` calls: ``hold`` is an allocation in one pool."""

    def __init__(self, allocator: FakeCachingAllocator, pool: StreamPool):
        self.allocator, self.pool = allocator, pool

    def hold(self, storage: torch.UntypedStorage, label: TaskLabel | None = None) -> None:
        self.allocator.allocate(storage, self.pool, label)
