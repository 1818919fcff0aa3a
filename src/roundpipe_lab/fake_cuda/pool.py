"""The fake CUDA backend ("fake_cuda"): the library's CUDA protocol on the fake driver's CPU streams.

``FakeCudaWorkerPool`` is ``lightning_roundpipe.workers.stream_pool.StreamWorkerPool``, the code that runs
on GPUs, over ``FakeStreams``: CI exercises the real protocol (issue order, events, holds, pinned
buffers) with a driver that behaves like CUDA where a defect could hide (docs/fake_cuda.md).
"""

from __future__ import annotations

import torch

from lightning_roundpipe.workers.stream_pool import StreamWorkerPool
from lightning_roundpipe.workers.host_buffers import DEFAULT_CAP_BYTES

from .allocator import FakeCachingAllocator, PoolTally, fake_gpu_capacity_bytes
from .streams import FakeStreams


class FakeCudaWorkerPool(StreamWorkerPool):
    """The CUDA protocol on CPU threads (see ``streams.py``): ``stream_jitter_s`` delays stream work
    at random (the race amplifier), ``seed`` fixes those delays; ``cudart`` answers pinning calls
    (a ``FakeCudart`` by default); ``copy_delay_s`` lands device-to-host copies that
    long after the work that issued them; ``check_residency``: a compute that reads a host tensor no
    upload moved fails with ``HostTensorOnWorkerError``, as CUDA would (``residency.py``; a Python call
    per operator, so off by default)."""

    backend = "fake_cuda"
    keeps_graphs_across_workers = True  # CPU threads standing for streams: one memory
    driver_class = FakeStreams  # the emulated backend's driver adds a device clock per stream

    @classmethod
    def options_from(cls, options) -> dict:
        """The CPU jitter knob delays stream work here (the race amplifier), with its seed."""
        return dict(stream_jitter_s=options.testing.jitter_s, seed=options.seed)

    def __init__(self, num_workers: int, timeout_s: float = 300.0, trace=None, max_in_flight: int = 2,
                 pin_memory: bool = True, fifo_transfers: bool = False,
                 stream_jitter_s: float = 0.0, seed: int = 0, host_buffer_cap_bytes: int = DEFAULT_CAP_BYTES,
                 cudart=None, copy_delay_s: float = 0.0, device_memory_bytes: int | None = None,
                 check_residency: bool = False):
        """``device_memory_bytes``: model CUDA's caching allocator (``model_allocator``) on fake GPUs of this size;
        ``check_residency``: see the class doc."""
        super().__init__(self.driver_class(stream_jitter_s, seed, cudart, copy_delay_s), [torch.device("cpu")] * num_workers,
                         timeout_s=timeout_s, trace=trace, max_in_flight=max_in_flight, pin_memory=pin_memory,
                         fifo_transfers=fifo_transfers, host_buffer_cap_bytes=host_buffer_cap_bytes)
        self.allocators: list[FakeCachingAllocator] = []  # one per worker once ``model_allocator`` was called
        self.residency = None
        if check_residency:
            from .residency import ResidencyCheck  # a test knob: imported when asked for

            self.residency = ResidencyCheck()
            for w in self.workers:
                self.driver.check_residency_on(w.lanes["compute"].stream, self.residency)
        if device_memory_bytes is not None:
            self.model_allocator(device_memory_bytes)

    def model_allocator(self, device_memory_bytes: int | None = None) -> None:
        """From the next task on, each worker is a fake GPU of ``device_memory_bytes`` with CUDA's caching
        allocator (``allocator.py``): what its upload and compute tasks allocate is charged to that
        stream's pool, up to the GPU less its context and workspaces, with allocator retries and
        ``torch.OutOfMemoryError`` as on CUDA (None: no limit, the pools measured only; a Python call per
        operator). Call between steps."""
        capacity = None if device_memory_bytes is None else fake_gpu_capacity_bytes(device_memory_bytes)
        self.allocators = []
        for w in self.workers:
            allocator = FakeCachingAllocator(capacity, f"fake GPU {w.index}", self.driver.stream_held_bytes)
            for queue in ("upload", "compute"):  # a download allocates host memory only
                self.driver.allocate_on(w.lanes[queue].stream, PoolTally(allocator, queue))
            self.allocators.append(allocator)

    def device_memory_stats(self) -> list[dict]:
        """As ``CudaWorkerPool.device_memory_stats``, from the modelled allocators (none before
        ``model_allocator``), with ``reserved_peak_bytes_by_pool``: each stream's pool's peak."""
        return [a.memory_stats() for a in self.allocators]

    def step_peak_device_bytes(self) -> list[int]:
        """Per worker, the larger of the ledger's peak and the modelled allocator's allocated peak."""
        ledger = self.peak_device_bytes()
        if not self.allocators:
            return ledger
        return [max(held, a.peak_allocated) for held, a in zip(ledger, self.allocators)]

    def reset_step_peaks(self) -> None:
        """Start the step's peaks afresh, the modelled allocators' included."""
        super().reset_step_peaks()
        for a in self.allocators:
            a.reset_peaks()
