"""Freed host memory kept for reuse: large tensors that come back every step stop page-faulting.

glibc's ``malloc`` serves a block above its mmap threshold (at most 32 MiB by default) with a
fresh ``mmap`` and gives it back with ``munmap`` when freed. A training step on the CPU backend
allocates the same large tensors every step: a language model's merged logits, the caller's
log-softmax and the logits' gradient (50 MB each on issue 22's bar model, 16 x 128 x 6144
floats). Each comes back as new pages, and every page faults on first touch: on the 2-core
development machine a copy into the merged logits plus ``F.cross_entropy`` forward and backward
on them took 153-162 ms with 49,156 page faults and 60-81 ms with none once freed blocks were
reused (one thread, medians of 10, 2026-12-02, load average 9 from other jobs,
``python benchmarks/figures/host_allocator_faults.py``). That host work runs while every
worker waits.

``keep_freed_memory`` raises glibc's mmap threshold and trim threshold to ``KEEP_BYTES``: blocks up
to that size come from the heap and freed ones stay there for the next allocation of that size.

It also sets glibc's top pad to ``KEEP_HEAPS_PAD`` (64 MiB). The threads other than the main one
(the workers' lanes) allocate from arenas made of heaps of at most 64 MiB. When a heap after an
arena's first one empties, glibc unmaps it whole, whatever the trim threshold, unless the heap
before it has less free room than the top pad. So a thread holding one large tensor that
allocates and frees another every step got a new heap, and new pages, every step (a 40 MiB block:
10,241 faults every time; with the pad, none after the first, ``tests/workers``). On issue 22's bar
model (``benchmarks.peers.out_of_box --bar``) that was 9,600-10,900 faults a step, and the pad
took them to 3,300-3,700 and the mean step from 549 / 483 ms to 475 / 449 ms (steps 5-12, two
runs each, 2026-12-05; ``docs/measurements.md`` section 12). The pad also makes the main heap grow
by that much more address space at a time; pages are only touched when used.

The cost: the process keeps up to ``KEEP_BYTES`` of freed memory it would have returned to the
OS, which a training loop allocates again every step anyway, and each thread keeps the heaps its
busiest step needed. It applies to the whole process (glibc has one setting) and stays for its
life: glibc cannot report the setting it replaces. On a C library other than glibc it does
nothing and says so (False).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

KEEP_BYTES = 1 << 30  # blocks up to 1 GiB from the heap; up to 1 GiB of freed heap kept
KEEP_HEAPS_PAD = 64 << 20  # M_TOP_PAD: a thread arena's heap is at most 64 MiB, so an emptied one is kept
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_kept: bool | None = None  # None: not tried yet


def _glibc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it (and mallopt's parameters as above)
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to ``KEEP_BYTES`` and its top pad to ``KEEP_HEAPS_PAD``
    (once per process); True when they are set."""
    global _kept
    with _lock:
        if _kept is None:
            libc = _glibc()
            _kept = bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)
                         and libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) and libc.mallopt(M_TOP_PAD, KEEP_HEAPS_PAD))
        return _kept
