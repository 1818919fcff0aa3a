"""Torch intra-op threads of one host thread, set so that they stay set.

torch initialises a thread's count lazily, on its first parallel call, from the last count *any*
thread set. The lanes set theirs (one thread each on the CPU backend) as they start, so a
caller's thread that had not made a parallel call yet would later take a lane's count: the
caller's loss and its whole-step optimizer, which run while every worker waits, would then run
on one thread of a machine whose other cores are idle. ``keep_intra_op_threads`` fixes the calling
thread's count before any lane starts; ``intra_op_threads`` lowers it for the host's own
pipelined phases (merging outputs, accumulating gradients while the workers compute) and gives
the caller's count back when they end.

Where the workers' threads already take every core (the CPU backend's default: as many workers
as cores, one thread each), the caller's thread gets one intra-op thread while the pool runs
(``caller_thread_limit``), and its own count back at shutdown. Its loss and optimizer then run
on one core while the workers wait, but no idle team of its intra-op threads spins on the cores
the workers compute on: torch's OpenMP threads busy-wait for new work for milliseconds after each
parallel region (libgomp's default spin count), and on 2 cores that took 11-15 ms of CPU per step
from the workers on a quiet machine and about 100 ms under load (``docs/measurements.md``).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch


def set_intra_op_threads(n: int) -> None:
    """Give the calling thread ``n`` intra-op threads. torch initialises a thread's count lazily,
    on its first parallel call, from the last count *any* thread set: a thread that only sets its
    count before that first call gets another thread's. Reading the count first initialises it."""
    torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))


def process_cores() -> int:
    """The cores this process may run on: its affinity mask, or the machine's count without one."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def caller_thread_limit(worker_threads: int, cores: int | None = None) -> int:
    """The intra-op threads the caller's thread may use beside ``worker_threads`` busy worker threads:
    the cores they leave free (``cores``, default ``process_cores()``), at least one."""
    return max(1, (process_cores() if cores is None else cores) - worker_threads)


def keep_intra_op_threads() -> int:
    """Fix the calling thread's intra-op count as it is now (reading it initialises it), so that
    threads started later and setting their own do not change it; returns it."""
    return torch.get_num_threads()


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """The calling thread runs with ``n`` intra-op threads inside the block and with its own
    count again after it (also when the block raises)."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(max(1, int(n)))
    try:
        yield
    finally:
        torch.set_num_threads(before)
