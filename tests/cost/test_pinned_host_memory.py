"""Issue 15 item 5: pinned bytes in the planner's host-memory figure, by hand-computed numbers."""

import torch
from torch import nn

from lightning_roundpipe import Plan
from lightning_roundpipe.cost.estimate import estimate_costs
from lightning_roundpipe.cost.memory import host_bytes
from lightning_roundpipe.cost.transformer import get_model_shape, preset_costs
from lightning_roundpipe.planning.capacity import plan_training


def test_pinned_bytes_of_three_fp32_linears_by_hand():
    costs = estimate_costs([nn.Linear(100, 100) for _ in range(3)], 8, None, torch.float32)
    plan = Plan(3, [(0, 1), (1, 3)], [(0, 2), (2, 3)])
    host = host_bytes(costs, plan, microbatches=2)
    params = 3 * 10_100
    assert host.params == params
    assert host.compute_copy == params * 4  # uploads read the fp32 masters
    assert host.gradient_downloads == params * 4  # one fp32 download buffer per trainable parameter
    # Saved for recompute: the input of backward stage B1 (layer 2), 8 rows x 100 fp32, per microbatch.
    assert host.saved_activations == 2 * 8 * 100 * 4
    assert host.pinned == 121_200 + 121_200 + 6_400
    assert host.undo_images == 12 * params  # the undo's before-images: fp32 master, Adam m and v
    assert host.total == 16 * params + host.pinned + 12 * params
    assert host.pinned_upload_bytes_per_param == 4.0


def test_plan_output_shows_pinned_memory_on_its_own_line():
    params = get_model_shape("qwen3-8b").num_params()
    report = plan_training("qwen3-8b", "rtx4090", 1024, find_max_seq_len=False)
    h = report.host
    # bf16 shadows; the fused call's gradient downloads: bf16 for bf16 uploads (Linear weights), fp32 for the
    # embedding and norms (4 B/param, all fp32, before the gradients of bf16 uploads were downloaded in bf16;
    # 2 B, the compute dtype, before bf16-mixed's trainable weights were found to download fp32 gradients)
    fp32_uploads = 151936 * 4096 + 36 * (2 * 4096 + 2 * 128) + 4096  # embedding, norms, q/k norms, final norm
    assert h.compute_copy == 2 * params and h.gradient_downloads == 2 * params + 2 * fp32_uploads
    assert h.pinned_upload_bytes_per_param == 2.0
    assert h.pinned == h.compute_copy + h.gradient_downloads + h.saved_activations
    line = next(l for l in report.to_text().splitlines() if l.startswith("Pinned host memory:"))
    assert line.startswith(f"Pinned host memory: {h.pinned / 2**30:.1f} GiB")
    assert "upload copy 2.0 B/param" in line
    lora = host_bytes(preset_costs("qwen3-8b", report.hardware, 1024, lora_rank=16))
    assert lora.gradient_downloads < h.gradient_downloads / 100  # only the adapters' gradients come home
