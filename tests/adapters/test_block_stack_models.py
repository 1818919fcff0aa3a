"""Block-stack models written the way people write them (nanoGPT, litgpt, nn.TransformerEncoder), as LightningModules.

Shared by tests/adapters/test_block_stack*.py; the one test here checks the models are what the parity tests assume.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ = 48, 12


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has no gradient: Adam would amplify noise
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's layout: transformer = ModuleDict(wte, wpe, drop, h, ln_f), lm_head tied to wte."""

    def __init__(self, layers=4, dim=32, heads=4):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, dim), wpe=nn.Embedding(SEQ, dim), drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(dim, heads) for _ in range(layers)]), ln_f=nn.LayerNorm(dim)))
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def rope_tables(seq, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    return torch.cat([angles, angles], dim=-1).cos(), torch.cat([angles, angles], dim=-1).sin()


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RopeBlock(nn.Module):
    """litgpt-style: the block takes (x, cos, sin, mask, padding), all but x the same for every block."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm_1, self.norm_2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc_1, self.fc_2 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.out = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x, cos, sin, mask, padding=None):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.norm_1(x)).split(c, 2))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        bias = mask if padding is None else mask + padding[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        h = self.norm_2(x)
        return x + self.out(F.silu(self.fc_1(h)) * self.fc_2(h))


class LitGPT(nn.Module):
    """litgpt's layout: rope tables and a causal mask built once, passed to every block, untied head."""

    def __init__(self, layers=3, dim=32, heads=4, padding=True):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, dim), h=nn.ModuleList([RopeBlock(dim, heads) for _ in range(layers)]),
            ln_f=nn.RMSNorm(dim)))
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        cos, sin = rope_tables(SEQ, dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.use_padding = padding

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        padding = torch.where(idx == 0, -1e4, 0.0) if self.use_padding else None  # token 0 is padding
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, self.cos[:t], self.sin[:t], mask, padding=padding)
        return self.lm_head(self.transformer.ln_f(x))


class EncoderLM(nn.Module):
    """An LM on nn.TransformerEncoder (batch_first, causal mask), as the PyTorch tutorials build one."""

    def __init__(self, layers=3, dim=32, heads=4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx):
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        return self.head(self.encoder(self.embed(idx) * math.sqrt(self.embed.embedding_dim), mask=mask, is_causal=True))


class LMModule(L.LightningModule):
    """A LightningModule around any of the models above: next-token loss, SGD (no momentum) or AdamW."""

    def __init__(self, model: nn.Module, opt="sgd", lr=0.1):
        super().__init__()
        self.model, self.opt, self.lr = model, opt, lr

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        if isinstance(self.model, NanoGPT):
            return self.model(idx, targets)[1]
        logits = self.model(idx)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr * 0.01, weight_decay=0.01)


def token_data(n=30, seed=3, pad=False):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (n, SEQ + 1), generator=g)
    if pad:  # right padding of varying length (token 0)
        for i in range(n):
            tokens[i, SEQ - i % 4:] = 0
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def loader(data, batch_size=6):
    return DataLoader(data, batch_size=batch_size)


def no_dropout(module: nn.Module) -> nn.Module:
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    return module


def test_models_are_block_stacks_with_the_expected_outputs():
    torch.manual_seed(0)
    idx = torch.randint(1, VOCAB, (2, SEQ))
    gpt = NanoGPT()
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    assert gpt(idx)[0].shape == (2, SEQ, VOCAB)
    assert LitGPT()(idx).shape == (2, SEQ, VOCAB)
    assert EncoderLM()(idx).shape == (2, SEQ, VOCAB)
