"""The attention blocks inside a layer, and the FLOPs their scores and weighted sums cost per token.

``estimate_costs`` prices a layer from its matmul parameters, ``2 x params`` FLOPs per token.
Attention adds work no parameter counts: each query's dot products with the keys it may see and
the weighted sum of their values, ``2 x q_dim`` FLOPs per key each. Under a causal mask a query
sees on average half of the sequence (flash attention skips the masked blocks), so per token

    4 x q_dim x min(context / 2, window)         (forward; recompute the same, backward twice)

with ``q_dim`` the heads times the head dimension and ``window`` a sliding window's width where
the block has one (the cost model's ``cost/attention.py`` prices the same FLOPs). At 2,048
tokens per sequence that is 8% of a Qwen3-1.7B decoder layer's forward (``q_dim`` 2,048 against
50M matmul parameters) and 4% of a Llama-3.1-8B one: small per layer, but the estimate balances
decoder layers against a large LM head, so leaving it out cut the first plan of a model like
Qwen3-1.7B 8% slower than the plan on measured costs (``analysis/own_engine.engine_estimate``).

A block is found by what attention modules expose rather than by class: an integer ``head_dim``
and the number of query heads as ``num_heads`` (``torch.nn.MultiheadAttention``, many custom
blocks) or as its ``config.num_attention_heads`` (Hugging Face attention modules); the window is
the module's own ``sliding_window`` when an integer (Hugging Face sets it on sliding layers only; a
config's ``sliding_window`` may be set where no layer slides, so it is not read). Blocks inside a
found block are not counted again.
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
