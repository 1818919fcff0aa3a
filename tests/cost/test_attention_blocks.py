"""Attention in the estimate before anything is measured (``cost/attention_blocks.py``): which blocks
are found, their FLOPs by hand, and the plan keeper pricing them for the first batch's sequences."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_roundpipe.cost.attention_blocks import attention_blocks, attention_flops_per_token
from lightning_roundpipe.cost.estimate import estimate_costs
from lightning_roundpipe.options import PartitionConfig
from lightning_roundpipe.planning.keeper_config import KeeperConfig
from lightning_roundpipe.planning.keeper import ASSUMED_TOKENS_PER_MICROBATCH, PlanKeeper

pytestmark = pytest.mark.timeout(120)


class Windowed(nn.Module):
    """A custom attention block: ``num_heads`` x ``head_dim`` queries over a sliding window."""

    def __init__(self, heads=2, head_dim=8, window=10):
        super().__init__()
        self.num_heads, self.head_dim, self.sliding_window = heads, head_dim, window
        self.proj = nn.Linear(heads * head_dim, heads * head_dim)
        self.inner = nn.MultiheadAttention(heads * head_dim, heads)  # inside a found block: not counted again

    def forward(self, x):
        return self.proj(x)


class HFStyle(nn.Module):
    """Hugging Face attention modules keep the head count on their config and ``sliding_window`` None
    on full-attention layers (a config's own ``sliding_window`` is not read)."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"num_attention_heads": 4, "sliding_window": 3})()
        self.head_dim, self.sliding_window = 16, None
        self.q_proj = nn.Linear(64, 64)

    def forward(self, x):
        return self.q_proj(x)


class Decoder(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 4)
        self.mlp = nn.Linear(width, width)

    def forward(self, x):
        return self.mlp(x)


def test_blocks_are_found_by_heads_and_head_dim_once_each():
    assert attention_blocks(nn.MultiheadAttention(32, 4)) == [(32, None)]
    assert attention_blocks(Windowed()) == [(16, 10)]
    assert attention_blocks(HFStyle()) == [(64, None)]
    assert attention_blocks(nn.Sequential(Decoder(), Decoder(16))) == [(32, None), (16, None)]
    assert attention_blocks(nn.Sequential(nn.Linear(8, 8), nn.Tanh())) == []


def test_attention_flops_by_hand():
    # causal: a query sees half the sequence on average, 4 x q_dim FLOPs per key (scores and weighted sum)
    assert attention_flops_per_token([(32, None)], 100) == 4 * 32 * 50
    assert attention_flops_per_token([(16, 10)], 100) == 4 * 16 * 10  # the window, not half the sequence
    assert attention_flops_per_token([(16, 10)], 8) == 4 * 16 * 4  # a window wider than half the sequence
    assert attention_flops_per_token([(32, None), (16, 10)], 100) == 6400 + 640
    with pytest.raises(ValueError, match="context_tokens must be at least 1"):
        attention_flops_per_token([(32, None)], 0)


def test_estimate_adds_attention_for_the_context_given():
    torch.manual_seed(0)
    layer = Decoder(32)
    plain = estimate_costs([layer], 4, None, torch.float32, flops_per_second=1.0).layers[0]
    priced = estimate_costs([layer], 4, None, torch.float32, flops_per_second=1.0, context_tokens=100).layers[0]
    assert priced.forward_s - plain.forward_s == pytest.approx(4 * 32 * 50 * 4, rel=1e-12)  # x 4 tokens
    assert priced.recompute_s == priced.forward_s and priced.backward_s == 2 * priced.forward_s
    assert (priced.weight_bytes, priced.grad_bytes) == (plain.weight_bytes, plain.grad_bytes)


def keeper(layers, microbatches=2):
    return PlanKeeper(layers, 2, KeeperConfig(PartitionConfig(), microbatches=microbatches, recompute="always",
                                                 flops_per_second=1e9),
                      fused_last=False)


def test_the_keeper_prices_attention_for_the_first_batchs_sequences():
    torch.manual_seed(0)
    layers = [nn.Embedding(50, 32), Decoder(32), Decoder(32), nn.Linear(32, 50)]
    k = keeper(layers)
    assert k.wants_first_batch  # the microbatch count is given, but the sequence length is not known yet
    assumed = k.moving.profile().layers[1].forward_s
    expected_assumed = estimate_costs(layers, ASSUMED_TOKENS_PER_MICROBATCH, None, torch.float32, flops_per_second=1e9,
                                      context_tokens=ASSUMED_TOKENS_PER_MICROBATCH).layers[1].forward_s
    assert assumed == expected_assumed
    k.first_batch(batch_size=4, tokens=4 * 64)  # 4 sequences of 64 tokens
    assert k.context_tokens == 64 and not k.wants_first_batch
    seen = k.moving.profile().layers[1].forward_s
    gap = 4 * 32 * (ASSUMED_TOKENS_PER_MICROBATCH / 2 - 64 / 2) * ASSUMED_TOKENS_PER_MICROBATCH / 1e9
    assert assumed - seen == pytest.approx(gap, rel=1e-9)
    assert k.first_batch(batch_size=4, tokens=4 * 8) is None  # once, before any step


def test_without_attention_the_first_batch_has_nothing_to_price():
    k = keeper([nn.Linear(8, 8), nn.Linear(8, 8)])
    assert not k.wants_first_batch and k.first_batch(batch_size=4, tokens=4) is None


def test_blocks_that_materialise_their_scores_and_what_the_estimate_adds_for_them():
    from lightning_roundpipe.cost.attention_blocks import materialised_score_heads

    eager, sdpa = HFStyle(), HFStyle()
    eager.config._attn_implementation, sdpa.config._attn_implementation = "eager", "sdpa"
    assert materialised_score_heads(eager) == 4 and materialised_score_heads(sdpa) == 0
    assert materialised_score_heads(nn.Sequential(Decoder(), Decoder(16))) == 8  # MultiheadAttention's training path
    assert materialised_score_heads(nn.Linear(8, 8)) == 0
    # Per token at 100-token sequences, fp32: one [4, 100, 100] score tensor is 4 x 100 x 4 bytes, kept once
    # (on top of the 64-wide output), two more at once in forward and in backward.
    layer = estimate_costs([nn.Sequential(eager, nn.Linear(64, 64))], 200, None, torch.float32,
                           context_tokens=100).layers[0]
    assert (layer.act_bytes_per_token, layer.graph_bytes_per_token) == (256, 256 + 1600)
    assert layer.forward_transient_bytes_per_token == layer.backward_transient_bytes_per_token == 3200
    plain = estimate_costs([nn.Sequential(sdpa, nn.Linear(64, 64))], 200, None, torch.float32,
                           context_tokens=100).layers[0]
    assert plain.graph_bytes_per_token is None and plain.forward_transient_bytes_per_token is None
