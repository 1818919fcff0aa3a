"""MoE layers are priced by the parameters a token runs through; their bytes stay the full count.

Hand-computed numbers throughout: a layer's forward FLOPs are ``2 * active matmul parameters``
per token plus one per output element (``cost/estimate.py``), weights and gradients are every
parameter in the compute dtype.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

from lightning_roundpipe.adapters.hf_causal_lm import CausalLMLayers
from lightning_roundpipe.cost.estimate import estimate_costs
from lightning_roundpipe.cost.experts import routed_experts
from lightning_roundpipe.cost.profile import StageCostModel
from lightning_roundpipe.planning.partition import partition
from lightning_roundpipe.planning.report import build_report
from lightning_roundpipe.schedule.plan import Plan

TOKENS, FLOPS = 8, 1e9


def tiny_mixtral_layer() -> nn.Module:
    config = MixtralConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=8, num_experts_per_tok=2, vocab_size=100)
    torch.manual_seed(0)
    return MixtralDecoderLayer(config, 0)


def test_mixtral_layer_runs_top_k_of_its_experts_but_moves_all_of_them():
    layer = tiny_mixtral_layer()
    attention = 32 * 32 + 2 * (16 * 32) + 32 * 32  # q, k, v (2 kv heads of 8), o
    norms, router = 2 * 32, 8 * 32
    one_expert = 2 * 64 * 32 + 32 * 64  # fused gate+up [2i, h] and down [h, i]
    params = attention + norms + router + 8 * one_expert
    active = attention + norms + router + 2 * one_expert
    assert (params, active) == (52544, 15680)
    [group] = routed_experts(layer)
    assert (group.num_experts, group.top_k, sum(p.numel() for p in group.params)) == (8, 2, 8 * one_expert)

    cost = estimate_costs([layer], TOKENS, None, torch.float32, flops_per_second=FLOPS).layers[0]
    assert cost.params == params and cost.active_params == active
    assert cost.forward_s == pytest.approx((2 * active * TOKENS + 32 * TOKENS) / FLOPS)  # output width: o_proj's 32
    assert cost.backward_s == pytest.approx(2 * cost.forward_s) and cost.recompute_s == cost.forward_s
    assert cost.weight_bytes == 4 * params and cost.grad_bytes == 4 * params  # every expert travels


def test_full_size_mixtral_and_qwen3_moe_layers_from_their_default_configs():
    with torch.device("meta"):  # shapes only: no memory, no download
        mixtral = MixtralDecoderLayer(MixtralConfig(), 0)
        qwen3_moe = Qwen3MoeDecoderLayer(Qwen3MoeConfig(), 0)
    h, i = 4096, 14336  # Mixtral-8x7B: 32 heads, 8 kv heads of 128, 8 experts, top-2
    shared = (2 * h * h + 2 * 1024 * h) + 2 * h + 8 * h
    assert [(c.params, c.active_params) for c in estimate_costs([mixtral], 512, None, torch.bfloat16).layers] == [
        (shared + 8 * 3 * h * i, shared + 2 * 3 * h * i)]
    assert (shared + 8 * 3 * h * i, shared + 2 * 3 * h * i) == (1451270144, 394305536)
    h, i = 2048, 768  # Qwen3MoeConfig's defaults: 32 heads and 4 kv heads of 64, q/k norms, 128 experts, top-8
    shared = (2 * h * h + 2 * 256 * h) + 2 * 64 + 2 * h + 128 * h
    cost = estimate_costs([qwen3_moe], 512, None, torch.bfloat16).layers[0]
    assert (cost.params, cost.active_params) == (shared + 128 * 3 * h * i, shared + 8 * 3 * h * i) == (613683328, 47452288)


def test_dense_layers_are_priced_as_before():
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=100)
    layer = LlamaDecoderLayer(config, 0)
    assert routed_experts(layer) == []
    params = 32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 32 * 64 + 2 * 32
    cost = estimate_costs([layer], TOKENS, None, torch.float32, flops_per_second=FLOPS).layers[0]
    assert cost.params == cost.active_params == params
    assert cost.forward_s == pytest.approx((2 * params * TOKENS + 32 * TOKENS) / FLOPS)  # 2 x all parameters


class ListedExpertsBlock(nn.Module):
    """A hand-written MoE block: a router and an ``nn.ModuleList`` of experts, ``num_experts`` / ``top_k`` on the block."""

    def __init__(self, width: int = 8, num_experts: int = 4, top_k: int = 1):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(num_experts))

    def forward(self, x):
        choice = self.router(x).argmax(-1, keepdim=True)
        return sum((choice == e) * expert(x) for e, expert in enumerate(self.experts))


def test_listed_experts_in_a_hand_written_block():
    block = ListedExpertsBlock()
    cost = estimate_costs([block], TOKENS, None, torch.float32, flops_per_second=FLOPS).layers[0]
    assert (cost.params, cost.active_params) == (32 + 4 * 64, 32 + 64)
    assert cost.forward_s == pytest.approx((2 * (32 + 64) * TOKENS + 8 * TOKENS) / FLOPS)


def test_routers_that_disagree_on_top_k_leave_the_layer_priced_dense():
    layer = nn.Sequential(ListedExpertsBlock(top_k=1), ListedExpertsBlock(top_k=2))
    assert routed_experts(layer) == []
    cost = estimate_costs([layer], TOKENS, None, torch.float32).layers[0]
    assert cost.active_params == cost.params == 2 * (32 + 4 * 64)
    # each block alone is routed
    assert [g.top_k for g in routed_experts(layer[0]) + routed_experts(layer[1])] == [1, 2]


# --------------------------------------------------------------------- a whole tiny Qwen3-MoE
def tiny_qwen3_moe_layers(num_layers: int, dense_layers: list[int], num_experts: int, top_k: int,
                          moe_width: int) -> list[nn.Module]:
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=moe_width,
                            num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=num_experts, num_experts_per_tok=top_k, mlp_only_layers=dense_layers)
    torch.manual_seed(0)
    return CausalLMLayers.from_model(Qwen3MoeForCausalLM(config)).layers


# per decoder layer: q 16x16, k and v 8x16, o 16x16, q/k norms of 8, two norms of 16
ATTENTION = 256 + 2 * 128 + 256 + 2 * 8 + 2 * 16
DENSE_MLP = 3 * 16 * 32


def test_plan_table_shows_bytes_against_compute_for_a_tiny_qwen3_moe():
    # prefix (embedding 64x16), 2 dense layers, 2 MoE layers (8 experts of width 8, top-2), postfix (norm + head)
    layers = tiny_qwen3_moe_layers(4, [0, 1], num_experts=8, top_k=2, moe_width=8)
    costs = estimate_costs(layers, 512, None, torch.float32, flops_per_second=5e10)
    expert = 3 * 16 * 8
    dense, moe, moe_active = ATTENTION + DENSE_MLP, ATTENTION + 8 * 16 + 8 * expert, ATTENTION + 8 * 16 + 2 * expert
    assert (dense, moe, moe_active) == (2352, 4016, 1712)
    assert costs.layer_params() == [1024, dense, dense, moe, moe, 1040]
    assert costs.layer_active_params() == [1024, dense, dense, moe_active, moe_active, 1040]

    plan = Plan(6, ((0, 2), (2, 6)), ((0, 2), (2, 6)), fused_last=True)
    report = build_report(plan, costs, 2, 4, stage_overhead_s=0.0)
    forward = [(16 * 512) / 5e10, (2 * dense + 16) * 512 / 5e10, (2 * moe_active + 16) * 512 / 5e10,
               (2 * 1040 + 64) * 512 / 5e10]  # prefix, dense, MoE, postfix (embedding is a lookup)
    fused_compute = 4 * 3 * (forward[1] + 2 * forward[2] + forward[3])  # 4 microbatches of forward + 2x backward
    first_compute = 4 * (forward[0] + forward[1])
    assert [r.compute_s for r in report.rows] == pytest.approx([first_compute, fused_compute, 3 * first_compute])
    assert [(r.params, r.active_params) for r in report.rows] == [
        (1024 + dense, 1024 + dense), (dense + 2 * moe + 1040, dense + 2 * moe_active + 1040), (1024 + dense, 1024 + dense)]

    lines = report.to_table().splitlines()
    assert lines[1].split() == ["stage", "direction", "layers", "worker", "predicted", "compute", "weights", "params",
                                "active", "activations"]
    rows = [line.split() for line in lines[3:6]]
    # stage, ..., compute, weights (value unit), params, active
    assert [row[:4] + row[6:11] for row in rows] == [
        ["F0", "forward", "0:2", "0", "194", "us", "13.22", "KiB", "3.38K"],
        ["F1", "fused", "2:6", "1", "1.7", "ms", "44.62", "KiB", "11.4K"],
        ["B0", "backward", "0:2", "0", "582", "us", "13.22", "KiB", "3.38K"],
    ]
    assert [row[11] for row in rows] == ["3.38K", "6.82K", "3.38K"]
    assert f"{first_compute * 1e6:.0f}" == "194" and f"{fused_compute * 1e3:.1f}" == "1.7"
    rotary = 2 * 4 * 4  # the prefix's inv_freq and original_inv_freq buffers (head_dim / 2 floats each)
    assert f"{((1024 + dense) * 4 + rotary) / 1024:.2f}" == "13.22"
    assert f"{(dense + 2 * moe + 1040) * 4 / 1024:.2f}" == "44.62"
    assert lines[6] == ("MoE layers 3, 4: 4.02K parameters each, 1.71K run per token "
                        "(2.3x the bytes per FLOP of a dense layer)")
    assert lines[7].startswith("predicted step ")
    assert [(m.layer, m.params, m.active_params) for m in report.moe_layers] == [(3, moe, moe_active), (4, moe, moe_active)]


def test_dense_plan_table_has_no_moe_line():
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    from transformers import LlamaForCausalLM

    layers = CausalLMLayers.from_model(LlamaForCausalLM(config)).layers
    costs = estimate_costs(layers, 64, None, torch.float32)
    report = build_report(Plan(4, ((0, 2), (2, 4)), ((0, 2), (2, 4))), costs, 2, 2)
    assert report.moe_layers == [] and report.moe_lines() == []
    assert not any(line.startswith("MoE") for line in report.to_table().splitlines())
    assert all(r.params == r.active_params for r in report.rows)


# --------------------------------------------------------------------- cutting an MoE model
def dense_priced(costs):
    """The same profile with every parameter priced as compute (what the estimate did before experts were known)."""
    def price(c):
        forward = c.forward_s + 2 * (c.params - c.active_params) * costs.tokens_per_microbatch / 5e10
        return dataclasses.replace(c, forward_s=forward, recompute_s=forward, backward_s=2 * forward)
    return dataclasses.replace(costs, layers=[price(c) for c in costs.layers])


def test_partitioner_cuts_moe_layers_by_their_active_compute_and_full_memory():
    # prefix, 3 dense layers, 3 MoE layers (16 experts of width 16, top-1), postfix
    layers = tiny_qwen3_moe_layers(6, [0, 1, 2], num_experts=16, top_k=1, moe_width=16)
    costs = estimate_costs(layers, 512, None, torch.float32, flops_per_second=5e10)
    moe, moe_active = ATTENTION + 16 * 16 + 16 * 3 * 16 * 16, ATTENTION + 16 * 16 + 3 * 16 * 16
    assert costs.layer_params()[4:7] == [moe] * 3 and costs.layer_active_params()[4:7] == [moe_active] * 3
    # an MoE layer computes less than a dense one (1840 vs 2352 active) but holds 5.7x its bytes
    assert costs.layers[4].forward_s < costs.layers[1].forward_s
    assert costs.layers[4].weight_bytes == 4 * moe == 53440

    active = partition("auto", costs, 2, 4, fused_last=True)
    as_dense = partition("auto", dense_priced(costs), 2, 4, fused_last=True)
    # by active compute the three cheap MoE layers join the fused stage; priced dense they looked 7x heavier
    assert active.to_text() == "F 0:3 3:8 | B 0:3 3:8 | fused"
    assert as_dense.to_text() == "F 0:5 5:8 | B 0:5 5:8 | fused"
    assert active.facts.predicted_step_s < partition("manual", costs, 2, 4, fused_last=True, manual_forward=[[0, 5], [5, 8]]
                                                     ).facts.predicted_step_s

    # memory is the full bytes: with half of 4 MB per stage the fused 3:8 (2936448 bytes) does not fit. Its
    # activations are the decoder layers' graphs of cost.activations (issue 43 item 12: they were priced as the
    # layers' outputs, 642688 bytes in all, under a 1 MB budget here)
    model = StageCostModel(costs, 4)
    assert model.stage("fused", 3, 8).memory_bytes == 2936448 > 2_000_000
    capped = partition("auto", costs, 2, 4, fused_last=True, memory_budget_bytes=4_000_000)
    assert capped.to_text() == "F 0:5 5:8 | B 0:3 3:5 5:8 | fused"
    assert max(capped.facts.stage_memory_bytes.values()) <= 2_000_000


def test_shape_presets_report_the_parameters_a_token_runs():
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.transformer import get_model_shape, preset_costs

    hw = load_hardware("rtx4090")
    shape = get_model_shape("qwen3-30b-a3b")  # 128 experts of 3 x 2048 x 768, top-8
    costs = preset_costs("qwen3-30b-a3b", hw, 1024)
    idle = (128 - 8) * 3 * 2048 * 768
    assert [(c.params, c.active_params) for c in costs.layers[1:-1]] == [
        (shape.decoder_layer_params(), shape.decoder_layer_params() - idle)] * 48
    assert costs.layers[0].active_params == costs.layers[0].params
    lora = preset_costs("qwen3-30b-a3b", hw, 1024, lora_rank=16)
    idle_adapters = (128 - 8) * 16 * (3 * 2048 + 3 * 768)  # gate, up (2048 -> 768) and down (768 -> 2048)
    assert lora.layers[1].params - lora.layers[1].active_params == idle + idle_adapters
    dense = preset_costs("qwen3-8b", hw, 1024)
    assert all(c.active_params == c.params for c in dense.layers)
