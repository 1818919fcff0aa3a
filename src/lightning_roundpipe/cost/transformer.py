"""Per-layer costs of a decoder-only transformer, estimated from its shape and a hardware profile.

The pipelined module has ``num_layers + 2`` layers (embedding prefix, decoder layers, norm + LM
head + loss postfix). Times are FLOPs over the profile's rate (or, with physical rates, matmuls at
the tensor rate plus element-wise traffic at memory bandwidth); bytes come from parameter counts
in the compute dtype; each layer also gives the activations autograd keeps and its trainable
parameters, for the memory planner. LoRA and Mixture-of-Experts layers are priced by what they
hold and what a token runs. The FLOP formulas: docs/design.md, design notes,
``cost/transformer.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import activations, attention, moe_loop
from .model_shape import LORA_TARGETS, ModelShape  # noqa: F401 (LORA_TARGETS re-exported)
from .profile import CostProfile, LayerCost
from .hardware import HardwareProfile
from .compiled import fused_elementwise_bytes_per_token
from .physical import LayerWork, has_physical_rates, layer_seconds

# Logits kept for the loss's backward, per token and vocabulary entry, on top of the compute-dtype
# logits: Hugging Face upcasts them to fp32 and cross-entropy saves its fp32 log-softmax.
_LOSS_FP32_COPIES = 2
_TOKEN_ID_BYTES = 8  # int64 input ids


# Published config.json numbers (Hugging Face model repositories of Qwen and Meta).
MODEL_PRESETS: dict[str, ModelShape] = {
    "qwen3-0.6b": ModelShape("Qwen3-0.6B", 1024, 3072, 16, 8, 128, 151936, 28, tie_embeddings=True, qk_norm=True),
    "qwen3-1.7b": ModelShape("Qwen3-1.7B", 2048, 6144, 16, 8, 128, 151936, 28, tie_embeddings=True, qk_norm=True),
    "qwen3-8b": ModelShape("Qwen3-8B", 4096, 12288, 32, 8, 128, 151936, 36, qk_norm=True),
    "qwen3-32b": ModelShape("Qwen3-32B", 5120, 25600, 64, 8, 128, 151936, 64, qk_norm=True),
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 4096, 14336, 32, 8, 128, 128256, 32),
    # Mixture-of-Experts (config.json of Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, openai/gpt-oss-20b).
    # GPT-OSS's alternating 128-token sliding-window attention, attention sinks and projection
    # biases are not modelled: attention is costed as full causal on every layer (an over-estimate).
    "qwen3-30b-a3b": ModelShape("Qwen3-30B-A3B", 2048, 6144, 32, 4, 128, 151936, 48, qk_norm=True,
                                num_experts=128, experts_per_token=8, expert_intermediate=768),
    "qwen3-235b-a22b": ModelShape("Qwen3-235B-A22B", 4096, 12288, 64, 4, 128, 151936, 94, qk_norm=True,
                                  num_experts=128, experts_per_token=8, expert_intermediate=1536),
    # QLoRA of Qwen3-235B-A22B as its users run it (docs/planning.md): a 4-bit NF4 base, LoRA on the
    # attention's q, k, v, o only. Adapters on every expert (128 x 3 per layer) would train 3.25B
    # parameters at r=16 (52 GB of fp32 optimizer state), each seeing 1/16 of the tokens; on the
    # attention, 51M parameters that every token trains, and the routing is left as pre-trained.
    "qwen3-235b-a22b-qlora": ModelShape("Qwen3-235B-A22B", 4096, 12288, 64, 4, 128, 151936, 94, qk_norm=True,
                                        num_experts=128, experts_per_token=8, expert_intermediate=1536,
                                        quantization="nf4", lora_targets="attention"),
    "gpt-oss-20b": ModelShape("GPT-OSS-20B", 2880, 2880, 64, 8, 64, 201088, 24,
                              num_experts=32, experts_per_token=4, expert_intermediate=2880),
}


FP32_BYTES = 4  # the host masters' dtype


@dataclass(frozen=True)
class ParamSplit:
    """Parameter counts of a layer (or of its trainable part): ``linear``, those autocast casts to the
    compute dtype (held by Linear layers alone, cost/autocast_cast.py), and the ``other`` ones
    (embeddings, norms, a tied head), which a mixed precision keeps in fp32."""

    linear: int
    other: int

    def device_bytes(self, trainable: "ParamSplit", dtype_bytes: int) -> tuple[int, int, int, int]:
        """(uploaded, held on the worker, gradient, gradient download) bytes of these parameters,
        ``trainable`` of them trainable, computing in ``dtype_bytes``. Under a mixed precision
        (``dtype_bytes`` < 4, priced as bf16-mixed) a trainable Linear weight travels in the compute
        dtype and is held as an fp32 leaf plus autocast's compute-dtype copy; every gradient is fp32 on
        the worker, and a Linear weight's is downloaded in bf16 (``autocast_cast.download_dtype``)."""
        if dtype_bytes >= FP32_BYTES:
            total = self.linear + self.other
            grads = (trainable.linear + trainable.other) * dtype_bytes
            return total * dtype_bytes, total * dtype_bytes, grads, grads
        upload = self.linear * dtype_bytes + self.other * FP32_BYTES
        held = upload + trainable.linear * FP32_BYTES
        downloads = trainable.linear * dtype_bytes + trainable.other * FP32_BYTES
        return upload, held, (trainable.linear + trainable.other) * FP32_BYTES, downloads


def projection_split(shape: ModelShape) -> ParamSplit:
    """The projections of one decoder layer (attention, the MLP or every expert), split as a mixed
    precision uploads them: Linear layers in the compute dtype, an MoE layer's experts in fp32
    (transformers 5 holds them as fused tensors, not Linear layers, so autocast does not cast them)."""
    attention = sum(a * b for a, b in shape.attention_shapes())
    mlp = (shape.num_experts if shape.is_moe else 1) * sum(a * b for a, b in shape.mlp_shapes())
    return ParamSplit(attention, mlp) if shape.is_moe else ParamSplit(attention + mlp, 0)


def get_model_shape(name: str | ModelShape) -> ModelShape:
    """A preset by name, case-insensitive (``"qwen3-8b"``, ``"Llama-3.1-8B"``), or the shape itself."""
    if isinstance(name, ModelShape):
        return name
    key = name.lower().replace("_", "-")
    if key not in MODEL_PRESETS:
        raise KeyError(f"unknown model preset {name!r}; presets: {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[key]


# Element-wise traffic of one decoder layer per token, forward, in bytes per element of the
# compute dtype (2-byte fp16/bf16 activations), as Hugging Face's eager Llama/Qwen3 layers run it
# (no kernel fusion; the reference benchmark runs these layers as they are):
# - RMSNorm upcasts to fp32 and back: to(fp32) r2 w4, pow r4 w4, mean r4, x * rsqrt r4 w4,
#   to(fp16) r4 w2, * weight r2 w2 = 36 bytes per normalised element (two per layer on
#   ``hidden``; Qwen3's q/k norms on ``q_dim + kv_dim``);
# - rotary embedding on q and k: q * cos r2 w2, rotate_half (neg on half, cat) r3 w3, * sin r2 w2,
#   the sum r4 w2 = 20 bytes per element;
# - two residual adds (r4 w2 = 6 per ``hidden`` element each);
# - the gated MLP: act(gate) r2 w2, * up r4 w2 = 10 per intermediate element.
# Backward moves about twice as much (the gradient of each input, reading what was saved).
_RMSNORM_BYTES = 36
_ROTARY_BYTES = 20
_RESIDUAL_BYTES = 6
_GATED_MLP_BYTES = 10


def elementwise_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2) -> float:
    """Forward element-wise traffic of one decoder layer per token (see the constants above)."""
    scale = dtype_bytes / 2  # the counts are for 2-byte activations
    mlp_width = shape.experts_per_token * shape.expert_intermediate if shape.is_moe else shape.intermediate
    qk = shape.q_dim + shape.kv_dim
    per_token = (2 * _RMSNORM_BYTES * shape.hidden + 2 * _RESIDUAL_BYTES * shape.hidden + _ROTARY_BYTES * qk
                 + (_RMSNORM_BYTES * qk if shape.qk_norm else 0) + _GATED_MLP_BYTES * mlp_width)
    return per_token * scale


def down_projection_work(shape: ModelShape) -> LayerWork:
    """Per token, a decoder layer's MLP down projection forward: ``2 x hidden x mlp width`` FLOPs (MoE: the
    routed experts' widths). The last operation of the layer but its residual add (fused into it when compiled):
    the work an early-stopping recompute leaves out (``engine/early_stop.py``). LoRA's adapter on it is left in."""
    width = shape.experts_per_token * shape.expert_intermediate if shape.is_moe else shape.intermediate
    return LayerWork(2 * shape.hidden * width)


def decoder_layer_work(shape: ModelShape, seq_len: int, lora_rank: int | None = None,
                       dtype_bytes: int = 2, compiled: bool = False) -> tuple[LayerWork, LayerWork]:
    """Forward and backward (recompute excluded) work of one decoder layer per token.

    Projections: ``2 x`` the parameters a token runs (MoE: router and routed experts only)
    forward; backward ``4 x`` (input and weight gradients) or ``2 x`` with LoRA (frozen base:
    input gradients only), plus the adapters' own. Attention (causal, flash attention skipping
    the masked half): ``2 * seq_len * q_dim`` forward, 2.5x that backward (flash attention's
    backward recomputes the scores: five matmuls to the forward's two). Element-wise traffic:
    ``elementwise_bytes_per_token``, twice that backward; ``compiled`` (the layer run through
    ``torch.compile``): the fused chains' traffic of ``cost.compiled`` instead.
    """
    linear = shape.active_linear_params()
    adapters = shape.active_lora_params_per_layer(lora_rank) if lora_rank else 0
    attn = 2 * seq_len * shape.q_dim
    if compiled:
        mlp_width = shape.experts_per_token * shape.expert_intermediate if shape.is_moe else shape.intermediate
        elementwise = fused_elementwise_bytes_per_token(shape.hidden, shape.q_dim + shape.kv_dim, mlp_width, dtype_bytes)
    else:
        elementwise = elementwise_bytes_per_token(shape, dtype_bytes)
    fwd = LayerWork(2 * linear + 2 * adapters, attn, elementwise)
    bwd = LayerWork((2 * linear if lora_rank else 4 * linear) + 4 * adapters, 2.5 * attn, 2 * elementwise)
    return fwd, bwd


def head_work(shape: ModelShape, lora_rank: int | None = None, dtype_bytes: int = 2,
              chunked_loss: bool = False) -> tuple[LayerWork, LayerWork]:
    """Forward and backward work of the final norm, LM head and loss per token.

    The head's matmul is ``2 * hidden * vocab`` FLOPs forward, twice that backward (once with
    LoRA: the frozen head needs only its input gradient). The cross-entropy's traffic: Hugging
    Face's loss writes the logits, reads and upcasts them to fp32 and writes and reads the fp32
    log-softmax (``2 * dtype + 8`` bytes per vocabulary entry forward, ``2 * dtype + 4``
    backward); a chunked compiled loss (``chunked_loss``: one fused kernel per chunk) writes and
    reads the logits once each way (``2 * dtype`` per entry forward and backward).
    """
    flops = 2 * shape.hidden * shape.vocab
    if chunked_loss:
        fwd_bytes = bwd_bytes = shape.vocab * 2 * dtype_bytes
    else:
        fwd_bytes, bwd_bytes = shape.vocab * (2 * dtype_bytes + 2 * 4), shape.vocab * (2 * dtype_bytes + 4)
    return LayerWork(flops, 0, fwd_bytes), LayerWork(flops if lora_rank else 2 * flops, 0, bwd_bytes)


def transformer_layer_costs(
    hidden: int,
    intermediate: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab: int,
    num_layers: int,
    seq_len: int,
    microbatch_size: int,
    dtype_bytes: int,
    hardware: HardwareProfile,
    lora_rank: int | None = None,
    *,
    tie_embeddings: bool = False,
    qk_norm: bool = False,
    loss_chunk_tokens: int | None = None,
    name: str = "",
) -> CostProfile:
    """Estimated ``CostProfile`` of one microbatch (``microbatch_size`` sequences of ``seq_len``).

    Layers: prefix (embedding), ``num_layers`` decoder layers, postfix (norm + LM head + loss).
    ``loss_chunk_tokens`` models a chunked cross-entropy that materialises the fp32 logits of only
    that many tokens at a time (default: all of them, as Hugging Face's loss does).
    """
    shape = ModelShape(name or "custom", hidden, intermediate, num_heads, num_kv_heads, head_dim, vocab, num_layers,
                       tie_embeddings=tie_embeddings, qk_norm=qk_norm)
    return shape_layer_costs(shape, hardware, seq_len, microbatch_size, dtype_bytes, lora_rank,
                             loss_chunk_tokens=loss_chunk_tokens)


def shape_layer_costs(
    shape: ModelShape,
    hardware: HardwareProfile,
    seq_len: int,
    microbatch_size: float = 1,
    dtype_bytes: int = 2,
    lora_rank: int | None = None,
    *,
    loss_chunk_tokens: int | None = None,
    fp16_accumulation: bool = False,
    loss_in_pipeline: bool = True,
    moe_dispatch: "str | moe_loop.ExpertDispatch | None" = None,
    compiled_layers: bool = False,
    early_stop: bool = False,
) -> CostProfile:
    """``transformer_layer_costs`` of a ``ModelShape`` (dense or MoE).

    ``microbatch_size`` may be fractional (a step of 128 sequences in 10 microbatches holds
    12.8 sequences per microbatch on average); the microbatch then holds the nearest whole
    number of tokens. ``fp16_accumulation``: projections and the LM head run at the profile's
    fp16-accumulate tensor rate (``torch.backends.cuda.matmul.allow_fp16_accumulation``).
    ``loss_in_pipeline`` False: the last stage returns the logits and the loss is computed
    outside (no labels travel, the logits are the last stage's output). Activation bytes come
    from ``activations``. ``moe_dispatch`` (MoE shapes): how the experts run, priced by
    ``cost/moe_loop.py`` (``"reference_loop"``, ``"hf_eager_loop"``, ``"grouped"``, ``"padded_bmm"``); None: the
    routed FLOPs alone. ``compiled_layers``: decoder layers run through ``torch.compile``, their
    element-wise chains fused (``cost.compiled``; memory is unchanged). ``early_stop``: the engine's
    ``recompute_early_stop``; each decoder layer's ``early_stop_s`` is its MLP down projection
    (``down_projection_work``), which a backward stage's last layer then does not recompute.
    """
    hidden, intermediate, vocab, num_layers = shape.hidden, shape.intermediate, shape.vocab, shape.num_layers
    qk_norm = shape.qk_norm
    if min(seq_len, dtype_bytes, num_layers) < 1 or not microbatch_size > 0:
        raise ValueError(f"seq_len, microbatch_size, dtype_bytes and num_layers must be >= 1, got "
                         f"{seq_len}, {microbatch_size}, {dtype_bytes}, {num_layers}")
    if lora_rank is not None and lora_rank < 1:
        raise ValueError(f"lora_rank must be a positive integer or None, got {lora_rank}")
    tokens = max(1, round(seq_len * microbatch_size))
    lora = lora_rank is not None

    def seconds(work: LayerWork) -> float:
        return layer_seconds(work, tokens, hardware, fp16_accumulation)

    def layer(fwd: LayerWork, bwd: LayerWork, params: "ParamSplit", trainable: "ParamSplit", act: int) -> LayerCost:
        f = seconds(fwd)
        upload, held, grads, downloads = params.device_bytes(trainable, dtype_bytes)
        return LayerCost(f, f, seconds(bwd), upload, grads, act, device_weight_bytes=held, download_grad_bytes=downloads)

    layers, params, trainable, graph = [], [], [], []
    carry = activations.carry_bytes(shape, dtype_bytes, labels=loss_in_pipeline)

    # Prefix: the embedding gather. Frozen under LoRA (adapters go on the projections only).
    emb = shape.embedding_params()
    layers.append(layer(LayerWork(hidden, 0, 2 * hidden * dtype_bytes), LayerWork(2 * hidden, 0, 2 * hidden * dtype_bytes),
                        ParamSplit(0, emb), ParamSplit(0, 0 if lora else emb), carry))
    layers[-1].act_grad_bytes_per_token = activations.hidden_grad_bytes(shape, dtype_bytes)
    params.append(emb)
    trainable.append(0 if lora else emb)
    # The embedding's backward needs only the token ids; its output carry is kept by the first
    # decoder layer (hidden state by its norm, cos and sin by the rotary multiplies).
    graph.append(carry)

    # Decoder layers.
    base = shape.decoder_layer_params()
    attn = 2 * seq_len * shape.q_dim  # causal attention scores + weighted sum, per token
    adapters = shape.lora_params_per_layer(lora_rank) if lora else 0
    active_adapters = shape.active_lora_params_per_layer(lora_rank) if lora else 0
    mlp_width = shape.experts_per_token * shape.expert_intermediate if shape.is_moe else intermediate
    fwd, bwd = decoder_layer_work(shape, seq_len, lora_rank, dtype_bytes, compiled=compiled_layers)
    if not has_physical_rates(hardware):
        bwd = LayerWork(bwd.matmul_flops, 2 * attn, bwd.memory_bytes)  # the estimate's FLOP count
    else:  # flash attention's rate at this length (cost/attention.py)
        factor = attention.attention_flops_factor(seq_len, hardware)
        fwd = replace(fwd, attention_flops=fwd.attention_flops * factor)
        bwd = replace(bwd, attention_flops=bwd.attention_flops * factor)
    saved = activations.decoder_graph_bytes(shape, dtype_bytes, lora_rank)
    transient = activations.decoder_backward_transient_bytes(shape, dtype_bytes)
    dispatch = moe_loop.DispatchCost(0.0, 0.0, 0, 0)
    if moe_dispatch is not None and shape.is_moe:
        dispatch = moe_loop.dispatch_cost(shape, tokens, hardware, moe_loop.for_shape(moe_dispatch, shape.name),
                                          dtype_bytes, fp16_accumulation)
    saved += dispatch.graph_bytes_per_token  # the padded dispatch's empty slots (cost/moe_loop.py)
    # Kept in fp32 under a mixed precision: the norms and, in an MoE layer, the router and the experts
    # (transformers 5 holds them as fused tensors, not Linear layers; so are their adapters).
    kept = shape.decoder_norm_params() + (base - shape.decoder_norm_params() - sum(
        a * b for a, b in shape.attention_shapes()) if shape.is_moe else 0)
    kept_adapters = adapters - sum(lora_rank * (a + b) for a, b in shape.attention_shapes()) if lora and shape.is_moe else 0
    decoder_trainable = (ParamSplit(adapters - kept_adapters, kept_adapters) if lora
                         else ParamSplit(base - kept, kept))
    for _ in range(num_layers):
        layers.append(layer(fwd, bwd, ParamSplit(base - kept + adapters - kept_adapters, kept + kept_adapters),
                            decoder_trainable, carry))
        layers[-1].forward_s += dispatch.forward_s
        layers[-1].recompute_s += dispatch.forward_s
        layers[-1].backward_s += dispatch.backward_s
        layers[-1].backward_transient_bytes_per_token = transient
        layers[-1].forward_transient_bytes_per_token = activations.decoder_forward_transient_bytes(
            shape, dtype_bytes, lora_rank)
        layers[-1].act_grad_bytes_per_token = activations.hidden_grad_bytes(shape, dtype_bytes)
        if early_stop:
            layers[-1].early_stop_s = seconds(down_projection_work(shape))
        params.append(base + adapters)
        trainable.append(adapters if lora else base)
        graph.append(saved)

    # Postfix: final norm + LM head + loss. Its output is the logits (or only a scalar when fused).
    head = shape.head_params()
    head_fwd, head_bwd = head_work(shape, lora_rank, dtype_bytes, chunked_loss=loss_chunk_tokens is not None)
    # A head tied to the embedding is also used by a lookup, so autocast does not cast it (cost/autocast_cast.py).
    head_matrix = ParamSplit(0, head - hidden) if shape.tie_embeddings else ParamSplit(head - hidden, 0)
    head_split = ParamSplit(head_matrix.linear, head_matrix.other + hidden)
    layers.append(layer(head_fwd, head_bwd, head_split, ParamSplit(0, 0) if lora else head_split, vocab * dtype_bytes))
    params.append(head)
    # A tied head's gradient travels home and adds into the embedding's; the optimizer updates
    # that matrix once, with the prefix, so only the final norm is the postfix's own.
    trainable.append(0 if lora else (hidden if shape.tie_embeddings else head))
    # Without autograd (a forward stage) the norm's normalised and weighted outputs exist beside the
    # logits (the output).
    layers[-1].forward_transient_bytes_per_token = 2 * hidden * dtype_bytes
    layers[-1].backward_transient_bytes_per_token = activations.postfix_backward_transient_bytes(
        shape, dtype_bytes, tokens, loss_chunk_tokens, loss_in_pipeline, trainable_head=not lora)
    graph.append(activations.postfix_graph_bytes(shape, dtype_bytes, tokens, not lora, loss_chunk_tokens,
                                                 loss_in_pipeline, _LOSS_FP32_COPIES))

    unique = shape.num_params() + (num_layers * adapters if lora else 0)
    # A token runs the routed experts of an MoE layer only (the report shows held versus run).
    idle_experts = (shape.num_experts - shape.experts_per_token) * sum(a * b for a, b in shape.mlp_shapes())
    active = [p - (adapters - active_adapters + idle_experts if 0 < i <= num_layers and shape.is_moe else 0)
              for i, p in enumerate(params)]
    for cost, p, t, g, a in zip(layers, params, trainable, graph, active):
        cost.params, cost.trainable_params, cost.graph_bytes_per_token, cost.active_params = p, t, g, a
    return CostProfile(layers, tokens_per_microbatch=tokens, measured=False, source=f"{shape.name} on {hardware.name}",
                       dtype_bytes=dtype_bytes, input_bytes_per_token=_TOKEN_ID_BYTES * (2 if loss_in_pipeline else 1),
                       unique_params=unique,
                       unique_trainable_params=(num_layers * adapters) if lora else unique,
                       decoder_layers=(1, 1 + num_layers),  # after the embedding prefix
                       extra_launches_per_decoder_layer=(dispatch.forward_launches,
                                                         dispatch.forward_launches + dispatch.backward_launches))


def preset_costs(
    model: str | ModelShape,
    hardware: HardwareProfile,
    seq_len: int,
    microbatch_size: int = 1,
    dtype_bytes: int = 2,
    lora_rank: int | None = None,
    loss_chunk_tokens: int | None = None,
) -> CostProfile:
    """``transformer_layer_costs`` for a preset name such as ``"qwen3-8b"`` (or a ``ModelShape``)."""
    return shape_layer_costs(get_model_shape(model), hardware, seq_len, microbatch_size, dtype_bytes, lora_rank,
                             loss_chunk_tokens=loss_chunk_tokens)
