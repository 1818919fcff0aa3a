"""Reusable host buffers for device-to-host copies, right-sized and kept per shape and dtype.

CUDA's caching host allocator rounds each pinned block up to a power of two and never gives it
back; here each download buffer is allocated at its exact size and, once the host has read it,
reused by the next copy of the same shape and dtype, so the bytes held stay at the first step's
peak. Free buffers beyond ``cap_bytes`` are evicted oldest first, and a buffer is lent again only
after the copy into it has landed (its ``fence`` event). Who returns buffers, and why the cap
bounds only what is kept: docs/design.md, design notes, ``workers/host_buffers.py``.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Iterable

import torch


DEFAULT_CAP_BYTES = 2 << 30


class HostBufferPool:
    """Free lists of host buffers by (shape, dtype); ``allocate(shape, dtype)`` makes a new one,
    ``on_evict(buffer)`` is told when one is dropped (to unpin it); ``cap_bytes``: see the module doc."""

    def __init__(self, allocate: Callable[[tuple, torch.dtype], torch.Tensor],
                 on_evict: Callable[[torch.Tensor], None] | None = None, cap_bytes: int = DEFAULT_CAP_BYTES) -> None:
        self._allocate = allocate
        self._on_evict = on_evict
        self.cap_bytes = int(cap_bytes)
        self._free: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self._lru: collections.OrderedDict = collections.OrderedDict()  # id -> (key, buffer), oldest return first
        self._fences: dict[int, object] = {}  # id of a buffer -> event after the copy into it
        self._lent: dict[int, tuple] = {}  # id of a lent buffer -> its key (only ours are taken back)
        self._lock = threading.Lock()
        self.evictions = 0
        self.fenced_skips = 0  # free buffers passed over because their copy had not finished
        self.allocated_bytes = 0  # every buffer this pool made and still holds or lends
        self.allocations = 0
        self.reuses = 0
        self.taken_bytes = 0  # over all takes, new or reused

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of ``shape`` and ``dtype``: a free one reused, else a new one."""
        key = (tuple(shape), dtype)
        with self._lock:
            buf = self._reusable_locked(key)
            if buf is not None:
                self.reuses += 1
        if buf is None:
            nbytes = _nbytes_of(key)
            evicted = self._evict(nbytes)
            buf = self._allocate(key[0], dtype)
            with self._lock:
                self.allocations += 1
                self.allocated_bytes += buf.numel() * buf.element_size()
            del evicted
        with self._lock:
            self._lent[id(buf)] = key
            self.taken_bytes += buf.numel() * buf.element_size()
        return buf

    def _reusable_locked(self, key) -> torch.Tensor | None:
        free = self._free.get(key)
        if not free:
            return None
        for i in range(len(free) - 1, -1, -1):  # the most recently returned first
            buf = free[i]
            if self._fence_done(buf):
                del free[i]
                self._lru.pop(id(buf), None)
                self._fences.pop(id(buf), None)
                return buf
            self.fenced_skips += 1
        return None

    def _fence_done(self, buf: torch.Tensor) -> bool:
        fence = self._fences.get(id(buf))
        return fence is None or fence.query()

    def _evict(self, incoming: int) -> list:
        """Drop the oldest free buffers whose copies are done until ``incoming`` more bytes fit under the cap."""
        dropped = []
        with self._lock:
            for bid, (key, buf) in list(self._lru.items()):
                if self.allocated_bytes + incoming <= self.cap_bytes:
                    break
                if not self._fence_done(buf):
                    continue
                del self._lru[bid]
                self._fences.pop(bid, None)
                free = self._free[key]
                del free[next(i for i, b in enumerate(free) if b is buf)]  # by identity: == on tensors is elementwise
                if not free:
                    del self._free[key]
                self.allocated_bytes -= buf.numel() * buf.element_size()
                self.evictions += 1
                dropped.append(buf)
        if self._on_evict is not None:
            for buf in dropped:
                self._on_evict(buf)
        return dropped

    def fence(self, tensors: Iterable[torch.Tensor | None], event) -> None:
        """``event`` completes once the copies into these lent buffers have landed."""
        with self._lock:
            for t in tensors:
                if t is not None and id(t) in self._lent:
                    self._fences[id(t)] = event

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
                    self._lru[id(t)] = (key, t)
                    n += 1
        return n

    @property
    def free_count(self) -> int:
        """Buffers kept for reuse now."""
        return len(self._lru)

    @property
    def lent_count(self) -> int:
        """Buffers lent out now."""
        return len(self._lent)

    def lent_bytes(self) -> int:
        """Bytes of the buffers lent out now."""
        return self.allocated_bytes - self.free_bytes()

    def free_bytes(self) -> int:
        """Bytes of the buffers waiting to be reused."""
        with self._lock:
            return sum(t.numel() * t.element_size() for q in self._free.values() for t in q)

    def clear(self) -> None:
        """Drop the free buffers (lent ones stay with their holders and are forgotten)."""
        with self._lock:
            self._free.clear()
            self._lru.clear()
            self._fences.clear()
            self._lent.clear()
            self.allocated_bytes = 0


def _nbytes_of(key) -> int:
    shape, dtype = key
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()
