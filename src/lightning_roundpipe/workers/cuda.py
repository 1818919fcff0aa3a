"""The CUDA backend (``CudaWorkerPool``) on real GPUs; the lab runs the same protocol on fake CPU streams.

Both run the stream protocol of ``stream_pool.py``; this file holds what differs: the devices
and drivers, each backend's options, and what the CUDA backend reads from its GPUs (the memory
budget, whether inductor compiles for them, the allocator's ``expandable_segments``). Allocation
pools and why: docs/design.md, design notes, ``workers/cuda.py``.
"""

from __future__ import annotations

import os

import torch

from ..cost.device_overheads import TWO_POOL_SHARE, device_reserved_bytes, two_pool_budget_bytes  # noqa: F401 (TWO_POOL_SHARE re-exported)
from .host_buffers import DEFAULT_CAP_BYTES
from .completions import Lane
from .stream_pool import StreamWorkerPool
from .cuda_streams import CudaStreams


TRITON_MIN_CAPABILITY = (7, 0)  # the oldest GPUs inductor's Triton kernels run on (Volta)


def inductor_generates_gpu_code(device_indices=None) -> bool:
    """Whether ``torch.compile``'s inductor can generate kernels for these GPUs (default: GPU 0):
    CUDA available, the ``triton`` package installed (inductor's GPU code generator, shipped with
    torch's CUDA wheels) and every GPU of compute capability ``TRITON_MIN_CAPABILITY`` or newer.
    Where it cannot, ``compile_layers=None`` keeps eager layers instead of failing at the first step."""
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return False
    indices = list(device_indices) if device_indices is not None else [0]
    return all(torch.cuda.get_device_capability(int(i)) >= TRITON_MIN_CAPABILITY for i in indices)


MEMORY_FRACTION = 0.9  # of what a GPU leaves after its context and workspaces: planning.capacity's default (tested)
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_expandable_segments() -> bool:
    """Turn on the caching allocator's ``expandable_segments`` (what the memory model assumes,
    ``cost/device_overheads.py``) unless the user configured it in ``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF``; it applies to the segments allocated from then on. Returns whether it set it."""
    if any("expandable_segments" in os.environ.get(name, "") for name in ALLOC_CONF_VARIABLES):
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")
    return True


def gpu_budget_bytes(total_bytes: int, capability: tuple[int, int]) -> int:
    """The runtime planner's per-worker budget on a GPU of ``total_bytes``: ``TWO_POOL_SHARE`` of what the memory
    model lets a worker's tensors fill (``usable_gpu_bytes``: ``MEMORY_FRACTION`` of the GPU less its CUDA context,
    cuBLAS workspaces and allocator pages, ``device_reserved_bytes``; an SM 9.x card's larger cuBLASLt workspace
    included), so that the two allocation pools' reserved bytes fit it."""
    return two_pool_budget_bytes(usable_bytes(total_bytes, capability))


def usable_bytes(total_bytes: int, capability: tuple[int, int]) -> int:
    """What the memory model lets a worker's tensors fill on a GPU of ``total_bytes``, as ``planning/capacity.py``
    plans it: ``MEMORY_FRACTION`` of the GPU less its context, workspaces and allocator pages."""
    return int(MEMORY_FRACTION * max(0, total_bytes - device_reserved_bytes(sm90=capability[0] == 9)))


class CudaWorkerPool(StreamWorkerPool):
    """The CUDA backend: one worker per entry of ``device_indices``, each with its own streams.

    Allocation pools: the caching allocator keeps one pool per stream, and blocks freed on one
    stream are reused only by allocations on that stream. Uploaded tensors (weights, activation
    and gradient uploads) are allocated on the upload stream, computed ones on the compute
    stream. Allocating the uploads in the compute stream's pool instead is not safe without
    ordering the upload after everything queued on the compute stream (a block freed there may
    still be read by queued kernels), which would end the prefetch's overlap, so the two pools stay;
    with ``expandable_segments`` (set unless the user configured it) a pool's free pages go back
    to the device page by page when the other needs them (an allocator retry, counted in
    ``torch.cuda.memory_stats()["num_alloc_retries"]``).
    """
    backend = "cuda"
    budget_option = ("partition.memory_budget_bytes (default: 4/7 of 90% of the GPU's memory less its CUDA context, "
                     "workspaces and allocator pages: two allocation pools)")

    @classmethod
    def create(cls, num_workers: int, device_indices=None, **options) -> "CudaWorkerPool":
        """One worker per entry of ``device_indices`` (default: GPUs ``0..num_workers-1``)."""
        return cls(device_indices if device_indices is not None else range(num_workers), **options)

    @classmethod
    def options_from(cls, options) -> dict:
        """Download buffers are pinned unless the pinned policy is "off"."""
        return dict(pin_memory=options.pinned != "off")

    @classmethod
    def default_compile_layers(cls, device_indices=None) -> bool:
        """Compiled layers by default where inductor generates GPU code (``inductor_generates_gpu_code``)."""
        return inductor_generates_gpu_code(device_indices)

    @classmethod
    def memory_budget_bytes(cls, device_indices, options) -> int | None:
        """``gpu_budget_bytes`` of the smallest GPU: what the memory model assumes a worker may fill, less the
        share its two allocation pools cost."""
        indices = list(device_indices) if device_indices is not None else [0]
        return min(gpu_budget_bytes(torch.cuda.get_device_properties(i).total_memory,
                                    tuple(torch.cuda.get_device_capability(i))) for i in indices)

    def __init__(self, device_indices, timeout_s: float = 300.0, trace=None, max_in_flight: int = 2,
                 pin_memory: bool = True, fifo_transfers: bool = False,
                 stream_jitter_cycles: int = 0, seed: int = 0, host_buffer_cap_bytes: int = DEFAULT_CAP_BYTES):
        """``device_indices`` may repeat a GPU: several workers (each with its own streams) on one device."""
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA backend needs CUDA: use accelerator='cpu' for virtual CPU workers")
        self.expandable_segments_set = use_expandable_segments()
        super().__init__(CudaStreams(stream_jitter_cycles, seed), [torch.device("cuda", int(i)) for i in device_indices],
                         timeout_s=timeout_s,
                         trace=trace, max_in_flight=max_in_flight, pin_memory=pin_memory,
                         fifo_transfers=fifo_transfers, host_buffer_cap_bytes=host_buffer_cap_bytes)

    def on_lane_start(self, lane: Lane) -> None:
        super().on_lane_start(lane)
        torch.cuda.set_device(lane.worker.device)
