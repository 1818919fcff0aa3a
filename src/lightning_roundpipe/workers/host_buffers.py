"""Reusable host buffers for device-to-host copies, right-sized and kept per shape and dtype.

On CUDA a download allocated per copy with ``torch.empty(..., pin_memory=True)`` goes through the
caching host allocator, which rounds each block up to a power of two and never gives memory
back: gradient and activation downloads of one step then cost up to twice their size in pinned
memory, held for the life of the process. Here each buffer is allocated at its exact size by the
driver and, once the host has consumed its data, returned to a free list for the next copy of
the same shape and dtype. A step downloads the same shapes as the step before, so after the
first step every download reuses a buffer and the bytes held stay at the first step's peak.

Who returns a buffer: the engine, when it knows nothing reads it any more (weight gradients
right after they are added into the host ``.grad``; activations when the call that kept them
for recompute is gone). A buffer handed to the user is simply never returned.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Iterable

import torch


class HostBufferPool:
    """Free lists of host buffers by (shape, dtype); ``allocate(shape, dtype)`` makes a new one."""

    def __init__(self, allocate: Callable[[tuple, torch.dtype], torch.Tensor]) -> None:
        self._allocate = allocate
        self._free: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self._lent: dict[int, tuple] = {}  # id of a lent buffer -> its key (only ours are taken back)
        self._lock = threading.Lock()
        self.allocated_bytes = 0  # every buffer this pool made and still holds or lends
        self.allocations = 0
        self.reuses = 0
        self.taken_bytes = 0  # over all takes, new or reused

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                buf = free.pop()
                self.reuses += 1
            else:
                buf = None
        if buf is None:
            buf = self._allocate(key[0], dtype)
            with self._lock:
                self.allocations += 1
                self.allocated_bytes += buf.numel() * buf.element_size()
        with self._lock:
            self._lent[id(buf)] = key
            self.taken_bytes += buf.numel() * buf.element_size()
        return buf

    def give_back(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """Return buffers this pool lent (others are ignored); the caller must not read them after.
        Returns how many came back."""
        n = 0
        with self._lock:
            for t in tensors:
                if t is None:
                    continue
                key = self._lent.pop(id(t), None)
                if key is not None:
                    self._free[key].append(t)
                    n += 1
        return n

    @property
    def lent_count(self) -> int:
        return len(self._lent)

    def lent_bytes(self) -> int:
        return self.allocated_bytes - self.free_bytes()

    def free_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for q in self._free.values() for t in q)

    def clear(self) -> None:
        """Drop the free buffers (lent ones stay with their holders and are forgotten)."""
        with self._lock:
            self._free.clear()
            self._lent.clear()
            self.allocated_bytes = 0
