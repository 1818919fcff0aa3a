"""Torch intra-op threads of one host thread, set so that they stay set.

torch initialises a thread's count lazily, on its first parallel call, from the last count *any*
thread set. The lanes set theirs (one thread each on the CPU backend) as they start, so a
caller's thread that had not made a parallel call yet would later take a lane's count: the
caller's loss and its whole-step optimizer, which run while every worker waits, would then run
on one thread of a machine whose other cores are idle. ``keep_intra_op_threads`` fixes the calling
thread's count before any lane starts; ``intra_op_threads`` lowers it for the host's own
pipelined phases (merging outputs, accumulating gradients while the workers compute) and gives
the caller's count back when they end.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def set_intra_op_threads(n: int) -> None:
    """Give the calling thread ``n`` intra-op threads. torch initialises a thread's count lazily,
    on its first parallel call, from the last count *any* thread set: a thread that only sets its
    count before that first call gets another thread's. Reading the count first initialises it."""
    torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))


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
