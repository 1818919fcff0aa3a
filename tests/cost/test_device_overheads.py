"""Issue 23 item 5: what a GPU holds beyond the model's tensors (cost/device_overheads.py), by hand, in the planner."""

import pytest

from lightning_roundpipe.cost import device_overheads as d
from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.transformer import get_model_shape
from lightning_roundpipe.planning.capacity import longest_seq_len

MiB = 2**20


def test_each_fixed_term_by_hand():
    assert d.CUDA_CONTEXT_BYTES == 500 * MiB
    assert d.CUBLAS_WORKSPACE_BYTES == 8_519_680 + 4 * MiB  # :4096:2:16:8 and the cuBLASLt workspace
    assert d.ALLOCATOR_SLACK_BYTES == 64 * MiB  # half a 2 MiB page for each of 64 live blocks
    assert d.device_reserved_bytes() == 500 * MiB + 8_519_680 + 4 * MiB + 64 * MiB
    assert d.device_reserved_bytes(sm90=True) == d.device_reserved_bytes() + 28 * MiB  # 32 MiB cuBLASLt on SM 9.x
    hw = load_hardware("rtx4090")
    assert d.usable_gpu_bytes(hw, 0.9) == pytest.approx((24 * 2**30 - d.device_reserved_bytes()) * 0.9)
    assert d.usable_gpu_bytes(hw.replace(gpu_memory_bytes=100 * MiB), 0.9) == 0
    assert d.usable_gpu_bytes(load_hardware("cpu2"), 0.9) == load_hardware("cpu2").gpu_memory_bytes * 0.9  # nothing reserved
    for name, sm90 in (("rtx4090", False), ("rtx3090", False), ("a100", False), ("h100", True), ("h200", True)):
        assert load_hardware(name).reserved_gpu_bytes == d.device_reserved_bytes(sm90), name


def test_the_flash_attention_workspace_by_hand():
    qwen3 = get_model_shape("qwen3-1.7b")  # 16 heads of 128, 8 KV heads
    # fp32 dQ (4 x 2048), softmax_d (4 x 16), fp16 dQ, dK, dV (2 x (2048 + 2 x 1024))
    assert d.attention_backward_bytes_per_token(qwen3) == 4 * 2048 + 4 * 16 + 2 * (2048 + 2048) == 16_448
    assert d.extra_attention_backward_bytes_per_token(qwen3, 24_576) == 0  # the MLP's gradients are larger
    moe = get_model_shape("qwen3-235b-a22b")  # 64 heads of 128, 4 KV heads; 8 x 1536 routed MLP width
    assert d.attention_backward_bytes_per_token(moe) == 4 * 8192 + 4 * 64 + 2 * (8192 + 1024) == 51_456
    assert d.extra_attention_backward_bytes_per_token(moe, 2 * 8 * 1536 * 2) == 51_456 - 49_152


@pytest.mark.timeout(60)
def test_the_planner_takes_the_overheads_off_each_gpu():
    hw = load_hardware("rtx4090")
    # Qwen3-1.7B on 8x RTX 4090: 123,904 tokens with 90% of 24 GiB usable; 120,576 with 90% of what the
    # context, workspaces and pages leave. A GPU larger by exactly those gives the old figure back.
    # (Before bf16-mixed kept norms and embeddings in fp32 with fp32 leaves and gradients on the worker,
    # cost/autocast_cast.py, these were 133,376 and 130,048: the weights a stage holds grew.)
    # (Since the planner budgets TWO_POOL_SHARE = 4/7 of that, the runtime's two-pool budget, these are 60,928 and
    # 62,720: 120,576 and 123,904 before.)
    assert longest_seq_len("qwen3-1.7b", hw) == 60_928
    assert longest_seq_len("qwen3-1.7b", hw.replace(gpu_memory_bytes=hw.gpu_memory_bytes + d.device_reserved_bytes())) == 62_720
