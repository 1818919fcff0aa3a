"""Torch intra-op threads of one host thread, set so that they stay set."""

from __future__ import annotations

import torch


def set_intra_op_threads(n: int) -> None:
    """Give the calling thread ``n`` intra-op threads. torch initialises a thread's count lazily,
    on its first parallel call, from the last count *any* thread set: a thread that only sets its
    count before that first call gets another thread's. Reading the count first initialises it."""
    torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))
