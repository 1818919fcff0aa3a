"""Worker pools: one interface; a CPU backend (virtual workers), a CUDA backend, and the CUDA
backend's protocol on fake CPU streams ("fake_cuda", for CI), and that protocol with device time from a
hardware profile ("emulated": emulated GPUs, ``emulated.py``)."""

from .cpu import CpuWorkerPool
from ..errors import PipelineError, PipelineTimeout, WorkerError
from .completions import Completion, TaskLabel
from .device_memory import WorkerOutOfMemoryError
from .lane_reports import LaneCounters
from .pool import Worker, WorkerPool

__all__ = [
    "Completion",
    "CpuWorkerPool",
    "LaneCounters",
    "PipelineError",
    "PipelineTimeout",
    "TaskLabel",
    "Worker",
    "WorkerError",
    "WorkerOutOfMemoryError",
    "WorkerPool",
    "BACKENDS",
    "backend_class",
    "make_pool",
]


BACKENDS = ("cpu", "cuda", "fake_cuda", "emulated")


def backend_class(backend: str) -> type[WorkerPool]:
    """The pool class of a backend name; its class attributes say what the backend is (see ``WorkerPool``)."""
    if backend == "cpu":
        return CpuWorkerPool
    if backend in ("cuda", "fake_cuda"):
        from .cuda import CudaWorkerPool, FakeCudaWorkerPool  # the stream backends, imported when asked for

        return CudaWorkerPool if backend == "cuda" else FakeCudaWorkerPool
    if backend == "emulated":
        from .emulated import EmulatedWorkerPool  # fake streams whose work lasts a profile's device time

        return EmulatedWorkerPool
    raise ValueError(f"unknown worker backend {backend!r}: use one of {', '.join(BACKENDS)}")


def make_pool(backend: str, num_workers: int, device_indices=None, **options) -> WorkerPool:
    """Build a pool: ``backend`` is "cpu" (virtual workers), "cuda" (one worker per GPU) or
    "fake_cuda" (the CUDA backend's protocol on CPU executor threads standing for streams; its
    own options ``stream_jitter_s`` and ``seed`` delay stream work at random) or "emulated" (the
same, each stream task lasting the device time ``EmulatedWorkerPool.emulate`` gives it). ``options`` are
    the backend's constructor arguments (``backend_class(backend).options_from`` takes them from
    the user's options)."""
    return backend_class(backend).create(num_workers, device_indices, **options)
