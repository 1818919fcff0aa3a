"""Mixture-of-Experts costs: every expert is held and uploaded, only the routed ones compute."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_roundpipe.cost.hardware import HardwareProfile
from lightning_roundpipe.cost.transformer import MODEL_PRESETS, ModelShape, shape_layer_costs

# One decoder layer: hidden 4, one head of 4, 3 experts of intermediate 2, 1 routed per token.
TINY = ModelShape("tiny-moe", hidden=4, intermediate=8, num_heads=1, num_kv_heads=1, head_dim=4, vocab=10,
                  num_layers=1, num_experts=3, experts_per_token=1, expert_intermediate=2)
TERA = HardwareProfile(name="tera", num_gpus=1, tflops=1.0, gpu_memory_bytes=10**12, host_device_bytes_per_s=1e12,
                       host_memory_bytes=10**12, cpu_optimizer_params_per_s=1e9)


def test_moe_parameters_count_every_expert_flops_count_routed_ones():
    # attention 4 x (4 x 4) = 64, one expert 2 x (4 x 2) + 2 x 4 = 24, router 4 x 3 = 12, norms 2 x 4.
    assert TINY.decoder_layer_params() == 64 + 3 * 24 + 12 + 8
    assert TINY.active_linear_params() == 64 + 1 * 24 + 12
    assert TINY.num_params() == 40 + 156 + 4 + 40  # embedding, layer, final norm + untied head
    layer = shape_layer_costs(TINY, TERA, seq_len=1).layers[1]
    # forward: 2 x 100 projection FLOPs + attention 2 x seq_len x q_dim = 8; backward 4 x 100 + 2 x 8.
    assert layer.forward_s == pytest.approx(208e-12)
    assert layer.backward_s == pytest.approx(416e-12)
    # bf16-mixed (cost/autocast_cast.py, a6938d8 and 5a516cd): the attention projections travel in bf16,
    # the norms, router and fused experts stay fp32 (transformers 5 holds experts as tensors); grads are fp32.
    assert (layer.weight_bytes, layer.grad_bytes, layer.trainable_params) == (2 * 64 + 4 * (3 * 24 + 12 + 8),
                                                                             4 * 156, 156)
    assert layer.device_weight_bytes == 6 * 64 + 4 * (3 * 24 + 12 + 8)  # fp32 leaf + bf16 copy per projection


def test_moe_lora_adapts_every_expert_but_computes_the_routed_ones():
    # rank 1: attention 4 x (4 + 4) = 32, one expert (4+2) + (4+2) + (2+4) = 18: 32 + 3 x 18 held, 32 + 18 run.
    assert TINY.lora_params_per_layer(1) == 86 and TINY.active_lora_params_per_layer(1) == 50
    layer = shape_layer_costs(TINY, TERA, seq_len=1, lora_rank=1).layers[1]
    assert layer.forward_s == pytest.approx((200 + 2 * 50 + 8) * 1e-12)
    assert layer.backward_s == pytest.approx((2 * 100 + 4 * 50 + 16) * 1e-12)  # dX of the frozen base only
    # The adapters' gradients are fp32 leaves' gradients under bf16-mixed (a6938d8): 4 B each.
    assert (layer.params, layer.trainable_params, layer.grad_bytes) == (156 + 86, 86, 4 * 86)


def test_more_experts_cost_memory_not_time_more_routed_experts_cost_time():
    base = shape_layer_costs(TINY, TERA, seq_len=1).layers[1]
    wider = shape_layer_costs(dataclasses.replace(TINY, num_experts=6), TERA, seq_len=1).layers[1]
    routed = shape_layer_costs(dataclasses.replace(TINY, experts_per_token=2), TERA, seq_len=1).layers[1]
    assert wider.forward_s == pytest.approx(base.forward_s + 2 * 4 * 3 * 1e-12)  # only the router grows
    # The added experts and router columns stay fp32 under bf16-mixed (5a516cd): 4 B each.
    assert wider.weight_bytes == base.weight_bytes + 4 * (3 * 24 + 4 * 3)
    assert routed.forward_s == pytest.approx(base.forward_s + 2 * 24 * 1e-12) and routed.weight_bytes == base.weight_bytes


@pytest.mark.parametrize("name,total,active", [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9),
                                               ("gpt-oss-20b", 20.9e9, 3.6e9)])
def test_moe_presets_match_their_model_cards(name, total, active):
    s = MODEL_PRESETS[name]
    assert s.num_params() == pytest.approx(total, rel=0.02)
    # Active parameters as the cards count them: every layer's routed path plus the LM head
    # (Qwen's figures also count the input embedding; GPT-OSS's do not).
    per_token = s.num_layers * (s.active_linear_params() + 2 * s.hidden) + s.vocab * s.hidden
    if name.startswith("qwen"):
        per_token += s.embedding_params()
    assert per_token == pytest.approx(active, rel=0.04)
