"""Worker pools: one interface; a CPU backend (virtual workers) and a CUDA backend, by name
(``backends.py``). The lab's fake drivers ("fake_cuda": the CUDA backend's protocol on fake CPU streams,
for CI; "emulated": that protocol with device time from a hardware profile) register themselves there."""

from .cpu import CpuWorkerPool
from ..errors import PipelineError, PipelineTimeout, WorkerError
from .completions import Completion, TaskLabel
from .device_memory import WorkerOutOfMemoryError
from .lane_reports import LaneCounters
from .pool import Worker, WorkerPool
from .backends import backend_class, known_backends, register_backend

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
    "backend_class",
    "known_backends",
    "make_pool",
    "register_backend",
]


def make_pool(backend: str, num_workers: int, device_indices=None, **options) -> WorkerPool:
    """Build a pool: ``backend`` is "cpu" (virtual workers), "cuda" (one worker per GPU) or a registered
    name (``register_backend``; the lab's "fake_cuda": the CUDA backend's protocol on CPU executor threads
    standing for streams, its own options ``stream_jitter_s`` and ``seed`` delaying stream work at random;
    "emulated": the same, each stream task lasting the device time its ``emulate`` gives it). ``options`` are
    the backend's constructor arguments (``backend_class(backend).options_from`` takes them from
    the user's options)."""
    return backend_class(backend).create(num_workers, device_indices, **options)
