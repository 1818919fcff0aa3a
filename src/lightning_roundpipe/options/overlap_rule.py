"""``overlap_optimizer=None``'s rule: whether this host has a core to spare for the optimizer thread."""

from __future__ import annotations

from ..host.threads import usable_cores


def overlap_optimizer_default(backend: str, num_workers: int, threads_per_worker: int = 1,
                              cores: int | None = None) -> bool:
    """``overlap_optimizer=None``'s rule: overlap only if a core is left for the optimizer thread.

    The pipeline keeps busy one core per worker thread (CPU backend: ``threads_per_worker``
    torch threads per worker; CUDA: the one thread that launches a GPU's kernels) plus the host
    thread that dispatches, accumulates and runs the loss. The overlapped optimizer's thread
    only pays when ``cores`` (default: this process's usable cores) exceed that; otherwise it
    slows the workers it shares cores with by more than it hides (measured: 2 CPU workers on 2
    cores ran at 0.69-0.86x of torch's 1F1B overlapped, 1.17x synchronous; issue 22)."""
    per_worker = threads_per_worker if backend == "cpu" else 1
    busy = num_workers * per_worker + 1
    return (usable_cores() if cores is None else cores) > busy

