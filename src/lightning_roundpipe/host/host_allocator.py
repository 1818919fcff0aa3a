"""Freed host memory kept for reuse: large tensors that come back every step stop page-faulting.

glibc returns large freed blocks to the OS at once, so every step's large fresh tensors (merged
logits, log-softmax, the logits' gradient) page-fault again while every worker waits.
``keep_freed_memory`` raises glibc's mmap and trim thresholds to ``KEEP_BYTES`` and its top pad
to ``KEEP_HEAPS_PAD``, for the whole process and its life (option ``cpu_reuse_freed_memory``);
it does nothing, and says so, on another C library. The measurements and the cost:
docs/design.md, design notes, ``host/host_allocator.py``.
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
