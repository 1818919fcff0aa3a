"""Torch intra-op threads of every host thread of ours: one rule, set explicitly as each starts.

torch initialises a thread's count lazily, on its first parallel call, from the last count *any*
thread set, so a thread that sets nothing runs with whatever count happened to be set last: a
count decided by timing. Every thread of ours sets its own as it starts (``set_intra_op_threads``),
from one rule per backend, read from the pool: a lane gets ``pool.lane_threads``
(CPU backend: ``threads_per_worker`` on a compute lane, 1 on a transfer lane; stream backends: 1,
its lanes only launch), a thread that only waits gets ``WAITING_THREADS`` (1), and the host
optimizer's thread gets the usable cores the compute lanes do not need (``host_optimizer_threads``).
``keep_intra_op_threads`` fixes the caller's count before any lane starts; the engine lowers it to
``HOST_PHASE_THREADS`` for the host's own pipelined phases (``engine.intra_op_threads``).
"""

from __future__ import annotations

import os

import torch

# Intra-op threads of the host (caller's) thread during a call's pipelined phases (submitting,
# merging outputs, accumulating gradients): the workers use the cores then (``engine.intra_op_threads``).
HOST_PHASE_THREADS = 1
# Threads that only wait (CUDA event waiters, the emulated stream clock, the all-reduce watcher):
# one thread, set anyway so that nothing they run inherits a count decided by timing.
WAITING_THREADS = 1


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def lane_cores(pool) -> int:
    """Cores the pool's lanes need while they run: each worker's compute lane's intra-op threads
    (``pool.lane_threads``; transfer lanes and waiters mostly wait, so they are not counted)."""
    return sum(pool.lane_threads(w.lanes["compute"]) for w in pool.workers if "compute" in w.lanes)


def host_optimizer_threads(pool=None, cores: int | None = None) -> int:
    """Intra-op threads of the host optimizer's thread: the ``cores`` (default: ``usable_cores()``)
    that the pipeline does not keep busy, at least 1: ``pool``'s compute lanes (``lane_cores``) and
    the host thread's pipelined phases (``HOST_PHASE_THREADS``), the same count as the rule that
    decides whether to overlap the optimizer at all (``options.overlap_optimizer_default``). The
    layer updates run while the pool computes (behind backward and the next forward), so the
    optimizer takes what the pipeline leaves; on a GPU backend each lane needs one core (launching),
    so it gets nearly every core. Without a pool: every usable core but the host thread's."""
    cores = usable_cores() if cores is None else int(cores)
    need = lane_cores(pool) if pool is not None and hasattr(pool, "workers") else 0
    return max(1, cores - need - HOST_PHASE_THREADS)


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
