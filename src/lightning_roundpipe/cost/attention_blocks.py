"""The attention blocks inside a layer, and the FLOPs their scores and weighted sums cost per token.

``estimate_costs`` prices a layer from its matmul parameters; attention adds work no parameter
counts, ``4 x q_dim x min(context / 2, window)`` FLOPs per token forward under a causal mask.
Small per layer, but leaving it out made the first plan of a model like Qwen3-1.7B 8% slower. A
block is found by what attention modules expose (``head_dim`` and ``num_heads`` or
``config.num_attention_heads``, a ``sliding_window``), not by class. Details: docs/design.md,
design notes, ``cost/attention_blocks.py``.
"""

from __future__ import annotations

from torch import nn


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _query_heads(module: nn.Module) -> int | None:
    heads = _int(getattr(module, "num_heads", None))
    if heads is None:
        heads = _int(getattr(getattr(module, "config", None), "num_attention_heads", None))
    return heads


def attention_blocks(layer: nn.Module) -> list[tuple[int, int | None]]:
    """``(q_dim, sliding window or None)`` of each attention block in ``layer`` (see the module doc)."""
    blocks: list[tuple[int, int | None]] = []
    inside: set[int] = set()
    for module in layer.modules():
        if id(module) in inside:
            continue
        head_dim, heads = _int(getattr(module, "head_dim", None)), _query_heads(module)
        if head_dim is None or heads is None:
            continue
        blocks.append((heads * head_dim, _int(getattr(module, "sliding_window", None))))
        inside.update(id(m) for m in module.modules())
    return blocks


def attention_flops_per_token(blocks: list[tuple[int, int | None]], context_tokens: int) -> float:
    """Forward FLOPs per token of ``blocks`` (``attention_blocks``) for causal sequences of
    ``context_tokens`` tokens: ``4 x q_dim x min(context / 2, window)`` each."""
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be at least 1, got {context_tokens}")
    total = 0.0
    for q_dim, window in blocks:
        seen = context_tokens / 2 if window is None else min(context_tokens / 2, window)
        total += 4.0 * q_dim * seen
    return total


def materialised_score_heads(layer: nn.Module) -> int:
    """Query heads of the blocks in ``layer`` that hold their ``[batch, heads, seq, seq]`` scores in
    memory: Hugging Face attention run ``eager`` (``config._attn_implementation``) and
    ``torch.nn.MultiheadAttention`` (its training path). Fused kernels (sdpa, flash) keep none."""
    heads = 0
    inside: set[int] = set()
    for module in layer.modules():
        if id(module) in inside:
            continue
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if isinstance(module, nn.MultiheadAttention) or (implementation == "eager" and _int(getattr(module, "head_dim", None))):
            heads += _query_heads(module) or 0
            inside.update(id(m) for m in module.modules())
    return heads
