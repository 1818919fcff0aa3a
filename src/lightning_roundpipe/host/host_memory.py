"""The host process's resident memory, for the memory metrics logged every step."""

from __future__ import annotations

import os


def host_rss_bytes() -> int:
    """Resident set size of this process now, in bytes (psutil where installed, else ``/proc``; 0 when neither)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.Process().memory_info().rss)
    try:
        with open("/proc/self/statm") as f:  # pages: size resident shared ...
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
