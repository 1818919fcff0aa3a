"""What a real GPU holds beyond the model's tensors: the CUDA context, cuBLAS workspaces, allocator pages.

The memory model (``cost/memory.py``) counts the tensors a worker's tasks create; a GPU process
also holds a CUDA context (500 MiB assumed), cuBLAS and cuBLASLt workspaces, partly used
allocator pages and flash attention's backward workspace. ``device_reserved_bytes`` sums the fixed
terms (0.56 GiB; 0.59 on SM 9.x), which the GPU profiles carry as ``reserved_gpu_bytes`` and the
planner takes off each GPU's memory. Where each figure comes from: docs/design.md, design notes,
``cost/device_overheads.py``.
"""

from __future__ import annotations

MiB = 2**20
CUDA_CONTEXT_BYTES = 500 * MiB
CUBLAS_WORKSPACE_BYTES = 2 * 4096 * 1024 + 8 * 16 * 1024 + 4 * MiB  # cuBLAS handle (:4096:2:16:8) + cuBLASLt
CUBLASLT_SM90_EXTRA_BYTES = 28 * MiB  # SM 9.x cards get a 32 MiB cuBLASLt workspace instead of 4
EXPANDABLE_PAGE_BYTES = 2 * MiB
LIVE_LARGE_BLOCKS = 64
ALLOCATOR_SLACK_BYTES = LIVE_LARGE_BLOCKS * EXPANDABLE_PAGE_BYTES // 2


def device_reserved_bytes(sm90: bool = False) -> int:
    """Bytes of one GPU the model's tensors cannot use: context, cuBLAS workspaces, allocator pages
    (``sm90``: a Hopper card's larger cuBLASLt workspace). GPU profiles carry it as ``reserved_gpu_bytes``."""
    return CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + ALLOCATOR_SLACK_BYTES + (CUBLASLT_SM90_EXTRA_BYTES if sm90 else 0)


def usable_gpu_bytes(hardware, memory_fraction: float) -> float:
    """What the planner lets a worker's tensors fill: ``memory_fraction`` of the memory left after the
    profile's ``reserved_gpu_bytes`` (0 for the CPU backend and hand-made profiles)."""
    return max(0.0, hardware.gpu_memory_bytes - hardware.reserved_gpu_bytes) * memory_fraction


# The runtime's planner fits every stage in half the budget b (``planning/budget.py``: a stage and its prefetch),
# a rule for one allocation pool. A CUDA worker has two (``workers/cuda.py``, ``CudaWorkerPool``: weights on the
# upload stream, activations and gradients on the compute stream), and neither reuses the other's cached
# blocks, so what they reserve adds up: the upload pool up to two stages' weights (b: a forward stage has no
# gradients, so its weights alone may fill b/2), the compute pool up to three gradients of a backward stage
# (the previous stage's, held until downloaded; the accumulated; the microbatch's new one: 3b/4, as a backward
# stage's weights and gradients share its b/2) and its activations. 1.75 b must fit the usable memory, or steps
# near the budget make allocator retries (tests/lab/test_fake_allocator.py: 5 in 3 steps of 2 workers at b = usable).
TWO_POOL_SHARE = 4 / 7


def two_pool_budget_bytes(usable_bytes: float) -> int:
    """The budget a worker's plan gets out of ``usable_bytes`` (``usable_gpu_bytes``): ``TWO_POOL_SHARE`` of it,
    so that the two allocation pools' reserved bytes fit. Both the runtime (``workers/cuda.py``) and the
    offline planner (``planning/capacity.py``, ``planning/fit.py``) budget a GPU with it."""
    return int(TWO_POOL_SHARE * usable_bytes)


def attention_backward_bytes_per_token(shape, dtype_bytes: int = 2) -> int:
    """FlashAttention-2's backward working set per token: fp32 dQ accumulator and softmax_d, and dQ, dK, dV."""
    return 4 * shape.q_dim + 4 * shape.num_heads + dtype_bytes * (shape.q_dim + 2 * shape.kv_dim)


def extra_attention_backward_bytes_per_token(shape, mlp_gradient_bytes_per_token: int, dtype_bytes: int = 2) -> int:
    """How far the attention backward's working set exceeds the MLP's gradients (the backward peak's other candidate)."""
    return max(0, attention_backward_bytes_per_token(shape, dtype_bytes) - mlp_gradient_bytes_per_token)
