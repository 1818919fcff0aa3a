"""Activation bytes per token of a decoder-only transformer as this project runs it (the Hugging Face layers).

Three numbers per layer feed the memory model (``cost/memory.py``): the carry a layer boundary
holds (``carry_bytes``), the graph autograd keeps for a layer's backward (``decoder_graph_bytes``,
``postfix_graph_bytes``) and the gradients alive at once while it back-propagates
(``decoder_backward_transient_bytes``). Every term was counted tensor by tensor on the CPU backend
with ``workers/device_memory.py``'s tally (``docs/memory.md``). Details: docs/design.md, design
notes, ``cost/activations.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .model_shape import ModelShape

FP32 = 4
INDEX_BYTES = 8  # int64 position ids and labels

DEFAULT_LOSS_CHUNK_TOKENS = 1024
"""Rows of logits the fused last stage of a Hugging Face model computes at a time (the chunked
loss's ``loss_chunk_size`` default, ``adapters/chunked_loss.py``); the planner's memory model
assumes the same. Defined here, below both, so the planner does not import the adapters."""


def _upcast(dtype_bytes: int) -> int:
    """Bytes per element of the fp32 copy an RMSNorm keeps (0 when the input already is fp32)."""
    return FP32 if dtype_bytes < FP32 else 0


def rms_norm_kept(width: int, dtype_bytes: int, trainable: bool) -> int:
    """Per token: the fp32 upcast (when narrower than fp32), the normalised input (kept by the
    multiply with a trainable weight) and the fp32 reciprocal RMS (kept by the normalising multiply)."""
    return width * _upcast(dtype_bytes) + (width * dtype_bytes if trainable else 0) + FP32


def carry_bytes(shape: "ModelShape", dtype_bytes: int, labels: bool = True) -> int:
    """Per token, the carry between two layers: the hidden state, the rotary cos and sin of the
    prefix (every stage reads them, so they travel with the hidden state), the position ids and,
    when the loss is computed in the pipeline, the labels."""
    rotary = 2 * shape.head_dim * dtype_bytes
    return shape.hidden * dtype_bytes + rotary + INDEX_BYTES + (INDEX_BYTES if labels else 0)


def decoder_graph_bytes(shape: "ModelShape", dtype_bytes: int, lora_rank: int | None) -> int:
    """Per token, what one decoder layer keeps for its backward, its output included."""
    d, h, q, kv = dtype_bytes, shape.hidden, shape.q_dim, shape.kv_dim
    heads, kv_heads = shape.num_heads, shape.num_kv_heads
    full = lora_rank is None  # LoRA freezes the norms' weights: their multiplies keep nothing
    mlp = shape.experts_per_token * shape.expert_intermediate if shape.is_moe else shape.intermediate
    # The two RMSNorms; their weighted outputs are kept by the projections after them (as the
    # input of the weight gradient, or of the LoRA adapter's A).
    out = 2 * (rms_norm_kept(h, d, full) + h * d)
    # The residual after attention and the layer output are kept by the next RMSNorm as its input
    # when that norm does not upcast (fp32); otherwise the upcast copy counted there is kept instead.
    out += 2 * h * d if not _upcast(d) else 0
    # v (kept by attention), and q and k after rotary (q * cos + rotate_half(q) * sin; the multiplies
    # by cos and sin keep only cos and sin, which belong to the carry).
    out += kv * d + (q + kv) * d
    if shape.qk_norm:
        # Qwen3's per-head RMSNorms on q and k keep their inputs (the projections' outputs, fp32
        # after the upcast) and, when trainable, the normalised q and k.
        out += (q + kv) * max(d, FP32) + (heads + kv_heads) * FP32 + ((q + kv) * d if full else 0)
    # Attention (flash / memory-efficient kernels) keeps its output (the o_proj input) and one fp32
    # log-sum-exp per head; no seq x seq scores.
    out += q * d + heads * FP32
    # Gated MLP: gate and up outputs, the activation of the gate and the product (down_proj input).
    out += 4 * mlp * d
    # MoE router logits (one per expert).
    out += shape.num_experts * d
    if lora_rank is not None:  # each adapted projection's A output, kept by its B
        out += (7 if shape.lora_on_mlp else 4) * lora_rank * d
    return out


def _mlp_width(shape: "ModelShape") -> int:
    return shape.experts_per_token * shape.expert_intermediate if shape.is_moe else shape.intermediate


def decoder_backward_transient_bytes(shape: "ModelShape", dtype_bytes: int) -> int:
    """Per token, the gradients alive at once on top of the graph while a decoder layer back-propagates:
    the MLP's gate and up gradients (the output gradient is the stage's gradient input, counted there)."""
    return 2 * _mlp_width(shape) * dtype_bytes


def decoder_forward_transient_bytes(shape: "ModelShape", dtype_bytes: int, lora_rank: int | None) -> int:
    """Per token, the most a decoder layer holds at once besides its input and output when it runs
    without autograd (a forward stage): in the MLP the residual, the norm's output, the activated
    gate, up and their product; a LoRA adapter's B output exists beside the base projection's."""
    mlp = _mlp_width(shape)
    return (3 * mlp + 2 * shape.hidden + (mlp if lora_rank is not None and shape.lora_on_mlp else 0)) * dtype_bytes


def hidden_grad_bytes(shape: "ModelShape", dtype_bytes: int) -> int:
    """Per token, the gradient a layer boundary carries back: only the hidden state gets one."""
    return shape.hidden * dtype_bytes


def postfix_graph_bytes(shape: "ModelShape", dtype_bytes: int, tokens: int, trainable_head: bool,
                        loss_chunk_tokens: int | None, loss_in_pipeline: bool, loss_fp32_copies: int) -> int:
    """Per token, the final norm + LM head (+ loss) stage's working set for its backward.

    ``loss_in_pipeline`` False: the stage returns the logits (kept as its output) and the loss
    is computed elsewhere. Otherwise, with ``loss_chunk_tokens`` (the chunked loss of
    ``adapters/chunked_loss.py``) the gradients are computed chunk by chunk inside the forward:
    the norm's output and the hidden-state gradient exist for all tokens, the fp32 logits of one
    chunk (plus their compute-dtype original when narrower) and a ``[chunk, hidden]`` product at a
    time, and an fp32 ``[vocab, hidden]`` weight-gradient accumulator per microbatch. Without it
    (Hugging Face's own loss) the compute-dtype logits and ``loss_fp32_copies`` fp32 copies
    (the upcast and the log-softmax) of every token are kept.
    """
    d, h, v = dtype_bytes, shape.hidden, shape.vocab
    norm = rms_norm_kept(h, d, trainable_head)
    if loss_in_pipeline and loss_chunk_tokens is not None:
        return int(norm + 2 * h * d + _chunk_bytes(shape, dtype_bytes, tokens, loss_chunk_tokens, trainable_head))
    if not loss_in_pipeline:
        # The norm's weighted output is kept by the head's weight gradient; the logits are the output.
        return norm + (h * d if trainable_head else 0) + v * d
    return int(2 * h * d + v * (d + loss_fp32_copies * FP32))


def _chunk_bytes(shape: "ModelShape", dtype_bytes: int, tokens: int, loss_chunk_tokens: int,
                 trainable_head: bool) -> float:
    """Per token: one chunk's logits (fp32, plus the compute-dtype original when narrower) and its
    ``[chunk, hidden]`` product, spread over the microbatch, and the fp32 weight-gradient
    accumulator when the head trains (a frozen head, under LoRA, has none)."""
    d, h, v = dtype_bytes, shape.hidden, shape.vocab
    chunk = min(loss_chunk_tokens, tokens) / tokens
    accumulator = v * h * FP32 / tokens if trainable_head else 0
    return chunk * (v * FP32 + (v * d if d < FP32 else 0) + h * d) + accumulator


def postfix_backward_transient_bytes(shape: "ModelShape", dtype_bytes: int, tokens: int,
                                     loss_chunk_tokens: int | None, loss_in_pipeline: bool,
                                     trainable_head: bool = True) -> int:
    """Per token, what back-propagating the LM head and the final RMSNorm adds on top of the stage's
    graph: the head's input gradient and four hidden-wide temporaries of the norm's chain rule
    (through the weight, the reciprocal RMS, the mean and the square). The chunked loss computed its
    gradients in the forward, whose chunk logits are gone by then: only what exceeds them is added."""
    norm_backward = 5 * shape.hidden * dtype_bytes
    if loss_in_pipeline and loss_chunk_tokens is not None:
        return max(0, int(norm_backward - _chunk_bytes(shape, dtype_bytes, tokens, loss_chunk_tokens, trainable_head)))
    return norm_backward


# Materialised attention scores (eager attention), counted on the CPU backend with the tally of
# ``workers/device_memory.py`` on a tiny llama at 1,024 and 4,096 tokens per sequence: a forward
# without autograd holds two ``[heads, seq, seq]`` tensors at once (the scores and the masked or
# softmaxed copy), a forward with autograd keeps one (the softmax output, for its backward) and
# back-propagating it adds two (the gradients of the probabilities and of the scores). Softmax
# runs in fp32, so elements are priced at least 4 bytes.
SCORES_FORWARD, SCORES_KEPT, SCORES_BACKWARD = 2, 1, 2


def scores_bytes_per_token(heads: int, context_tokens: int, dtype_bytes: int) -> int:
    """Per token, one ``[heads, seq, seq]`` tensor of attention scores for sequences of ``context_tokens``."""
    return heads * context_tokens * max(dtype_bytes, FP32)


def dense_mask_bytes_per_token(mask_kinds: int, context_tokens: int, element_bytes: int) -> int:
    """Per token, ``mask_kinds`` dense ``[batch, 1, seq, seq]`` attention masks (eager attention's additive
    masks, one per attention kind) of ``element_bytes`` elements: they travel in the carry."""
    return mask_kinds * context_tokens * element_bytes


# Fused attention kernels (``attn_implementation="sdpa"``) keep no scores. What they keep, counted with the
# tally of ``workers/device_memory.py`` on torch 2.13's CPU kernel (fp32, 2 heads of 8, 1 KV head, 4,096 tokens;
# ``benchmarks/figures/sdpa_cpu_memory.py``): with no mask, with ``is_causal``, with a float mask and with
# ``enable_gqa`` alike, every call runs ``_scaled_dot_product_flash_attention_for_cpu``, which keeps its output
# and one fp32 log-sum-exp per head and query (in ``decoder_graph_bytes``); its backward creates the q, k and v
# gradients (within ``decoder_backward_transient_bytes``). A boolean mask (Hugging Face's sdpa masks where a row
# is padded, sequences are packed, or a sliding window or chunk is shorter than the sequence) is first turned
# into an additive ``[batch, 1, seq, seq]`` mask of the query's dtype (``aten.where``) that the call keeps for
# its backward: one per attention layer, on top of the boolean mask the carry holds. The kernels' own workspaces
# (per-thread blocks, about 1 MiB forward and 2 MiB backward there, whatever the length) are not tensors the
# tally sees. GPU rule (from torch's sdpa dispatch, not measured here): the boolean mask is converted the same
# way before a kernel is chosen; flash attention (no mask) and the memory-efficient kernel (with one, and for
# fp32) keep the same output, log-sum-exp and additive mask, so the same bytes are priced; the math fallback,
# which materialises scores, is chosen only where neither kernel applies and is not priced.
SDPA_MASK_ELEMENT_BYTES = 1  # the carry's boolean mask


def sdpa_kept_mask_bytes_per_token(context_tokens: int, dtype_bytes: int) -> int:
    """Per token, the additive copy of a boolean ``[batch, 1, seq, seq]`` mask that one sdpa call keeps."""
    return context_tokens * dtype_bytes


def decoder_activation_bytes(shape: "ModelShape", dtype_bytes: int, lora_rank: int | None) -> dict[str, int]:
    """Per token, one decoder layer's activation bytes as ``LayerCost`` fields name them (attention scores and
    masks aside): the carry it passes on, its output gradient, its graph and its two transients."""
    return dict(act_bytes_per_token=carry_bytes(shape, dtype_bytes),
                act_grad_bytes_per_token=hidden_grad_bytes(shape, dtype_bytes),
                graph_bytes_per_token=decoder_graph_bytes(shape, dtype_bytes, lora_rank),
                forward_transient_bytes_per_token=decoder_forward_transient_bytes(shape, dtype_bytes, lora_rank),
                backward_transient_bytes_per_token=decoder_backward_transient_bytes(shape, dtype_bytes))
