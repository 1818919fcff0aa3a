"""``sim plan`` for a bf16 full fine-tune prices the weights as a worker holds them under bf16-mixed
(cost/autocast_cast.py): Linear weights as fp32 leaves plus autocast's bf16 copy, norms and the
embedding in fp32, every gradient in fp32."""

import dataclasses

import pytest

from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.memory import roundpipe_gpu_bytes
from lightning_roundpipe.cost.transformer import get_model_shape, preset_costs
from lightning_roundpipe.planning.capacity import plan_training
from lightning_roundpipe.sim.__main__ import main

GiB = 2**30


@pytest.mark.timeout(120)
def test_sim_plan_shows_the_gpu_bytes_of_fp32_leaves_and_gradients(capsys):
    hw = load_hardware("rtx4090")
    shape = get_model_shape("qwen3-0.6b")
    costs = preset_costs("qwen3-0.6b", hw, 512, loss_chunk_tokens=1024)
    norms = shape.decoder_norm_params()
    linear = shape.decoder_layer_params() - norms
    decoder = costs.layers[1]
    assert (decoder.weight_bytes, decoder.device_weight_bytes, decoder.grad_bytes) == (
        2 * linear + 4 * norms, 6 * linear + 4 * norms, 4 * (linear + norms))
    embed = shape.embedding_params()
    assert (costs.layers[0].weight_bytes, costs.layers[0].device_weight_bytes, costs.layers[0].grad_bytes) == (
        4 * embed, 4 * embed, 4 * embed)

    report = plan_training("qwen3-0.6b", hw, 512, microbatches=8, find_max_seq_len=False)
    plan = report.choice.plan
    need = max(roundpipe_gpu_bytes(plan, costs, hw.num_gpus, recompute=report.recompute))
    assert report.choice.gpu_bytes == need
    # The same plan priced as before (every weight and gradient in bf16, nothing more held) needs less.
    old = dataclasses.replace(costs, layers=[dataclasses.replace(c, weight_bytes=c.params * 2, device_weight_bytes=None,
                                                                 grad_bytes=c.grad_bytes // 2) for c in costs.layers])
    assert max(roundpipe_gpu_bytes(plan, old, hw.num_gpus, recompute=report.recompute)) < need

    assert main(["plan", "--model", "qwen3-0.6b", "--hardware", "rtx4090", "--seq-len", "512", "--microbatches", "8",
                 "--no-max-seq"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"GPU memory per worker: {need / GiB:.1f} GiB needed") for line in lines), lines
