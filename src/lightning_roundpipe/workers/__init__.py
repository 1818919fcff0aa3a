"""Worker pools: one interface, a CPU backend (virtual workers) and a CUDA backend."""

from .cpu import CpuWorkerPool
from .completions import Completion, PipelineError, PipelineTimeout, TaskLabel, WorkerError
from .pool import Worker, WorkerPool

__all__ = [
    "Completion",
    "CpuWorkerPool",
    "PipelineError",
    "PipelineTimeout",
    "TaskLabel",
    "Worker",
    "WorkerError",
    "WorkerPool",
    "make_pool",
]


def make_pool(backend: str, num_workers: int, device_indices=None, **options) -> WorkerPool:
    """Build a pool: ``backend`` is "cpu" (virtual workers) or "cuda" (one worker per GPU)."""
    if backend == "cpu":
        return CpuWorkerPool(num_workers, **options)
    if backend == "cuda":
        from .cuda import CudaWorkerPool

        cuda_opts = {k: v for k, v in options.items() if k in ("timeout_s", "trace", "max_in_flight", "pin_memory", "fifo_transfers")}
        return CudaWorkerPool(device_indices if device_indices is not None else range(num_workers), **cuda_opts)
    raise ValueError(f"unknown worker backend {backend!r}: use 'cpu' or 'cuda'")
