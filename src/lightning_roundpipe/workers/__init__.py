"""Worker pools: one interface; a CPU backend (virtual workers), a CUDA backend, and the CUDA
backend's protocol on fake CPU streams ("fake_cuda", for CI)."""

from .cpu import CpuWorkerPool
from .completions import Completion, PipelineError, PipelineTimeout, TaskLabel, WorkerError
from .device_memory import WorkerOutOfMemoryError
from .pool import Worker, WorkerPool

__all__ = [
    "Completion",
    "CpuWorkerPool",
    "PipelineError",
    "PipelineTimeout",
    "TaskLabel",
    "Worker",
    "WorkerError",
    "WorkerOutOfMemoryError",
    "WorkerPool",
    "BACKENDS",
    "make_pool",
]


BACKENDS = ("cpu", "cuda", "fake_cuda")
_STREAM_OPTIONS = ("timeout_s", "trace", "max_in_flight", "pin_memory", "fifo_transfers", "issue_after_device",
                   "host_buffer_cap_bytes")


def make_pool(backend: str, num_workers: int, device_indices=None, **options) -> WorkerPool:
    """Build a pool: ``backend`` is "cpu" (virtual workers), "cuda" (one worker per GPU) or
    "fake_cuda" (the CUDA backend's protocol on CPU executor threads standing for streams; its
    own options ``stream_jitter_s`` and ``seed`` delay stream work at random, ``cudart`` and
    ``copy_delay_s`` fake pinning answers and late-landing copies). Stream backends also take
    ``host_buffer_cap_bytes`` (the download-buffer pool's cap, see ``host_buffers.py``)."""
    if backend == "cpu":
        return CpuWorkerPool(num_workers, **{k: v for k, v in options.items()
                                             if k not in ("stream_jitter_s", "stream_jitter_cycles", "host_buffer_cap_bytes",
                                                          "cudart", "copy_delay_s")})
    if backend == "cuda":
        from .cuda import CudaWorkerPool

        cuda_opts = {k: v for k, v in options.items() if k in _STREAM_OPTIONS + ("stream_jitter_cycles", "seed")}
        return CudaWorkerPool(device_indices if device_indices is not None else range(num_workers), **cuda_opts)
    if backend == "fake_cuda":
        from .cuda import FakeCudaWorkerPool

        fake_opts = {k: v for k, v in options.items() if k in _STREAM_OPTIONS + ("stream_jitter_s", "seed", "cudart", "copy_delay_s")}
        return FakeCudaWorkerPool(num_workers, **fake_opts)
    raise ValueError(f"unknown worker backend {backend!r}: use one of {', '.join(BACKENDS)}")
