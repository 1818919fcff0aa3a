"""What each Hugging Face decoder family's own ``forward`` does beyond embed -> layers -> norm -> head.

The adapter derives what it can from the model's modules: scaled embeddings live in the
embedding module (Gemma), residual and attention multipliers and attention soft-capping live in
the decoder layers (Granite, Gemma2), a rotary module whose ``forward`` takes ``layer_type``
means one rotary embedding per layer type (Gemma3), a ``router_logits`` output recorder in
``_can_record_outputs`` names the MoE router. What remains is written in ``ForCausalLM.forward``
or ``Model.forward`` as arithmetic on config values; it is declared here, one small entry per
family, each backed by a parity test (tests/adapters/test_family_parity.py).

A family missing from ``FAMILIES`` is *unverified*: refused unless the user passes
``allow_unverified=True``, which runs a parity check on the first microbatch first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    """Where a family keeps its modules (dotted paths from the ``...ForCausalLM``).

    positions: a learned absolute position embedding added to the token embeddings (GPT-2);
    rotary: the rotary module (None: the family has none, its layers get no position embeddings);
    embedding_dropout: a dropout module ``Model.forward`` applies to the embeddings.
    """

    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    norm: str = "model.norm"
    rotary: str | None = "model.rotary_emb"
    head: str = "lm_head"
    positions: str | None = None
    embedding_dropout: str | None = None


LLAMA_LAYOUT = Layout()


@dataclass(frozen=True)
class Family:
    """The config-driven arithmetic of one family's ``forward`` (attribute names on its config).

    embedding_multiplier: the model multiplies the token embeddings by this (Granite).
    embedding_dropout: dropout probability applied to the embeddings in ``Model.forward`` (Starcoder2).
    logit_multiplier: logits are multiplied by this (Cohere's ``logit_scale``).
    logit_divisor: logits are divided by this (Granite's ``logits_scaling``).
    logit_softcap: ``cap * tanh(logits / cap)`` when the value is not None (Gemma2, Gemma3).
    refused_when: (config attribute, reason) pairs: a truthy value makes the model unsupported.
    layout: where the modules are (Llama's layout by default).
    layer_kwargs: extra keyword arguments every decoder layer call gets (Falcon's ``alibi=None``).
    """

    embedding_multiplier: str | None = None
    embedding_dropout: str | None = None
    logit_multiplier: str | None = None
    logit_divisor: str | None = None
    logit_softcap: str | None = None
    refused_when: tuple[tuple[str, str], ...] = ()
    layout: Layout = LLAMA_LAYOUT
    layer_kwargs: tuple[tuple[str, Any], ...] = ()


_BIDIRECTIONAL = (("use_bidirectional_attention", "bidirectional attention is an encoder set-up, not a causal LM"),)

PLAIN = Family()

FAMILIES: dict[str, Family] = {
    # dense, Llama-shaped (model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head)
    "llama": PLAIN,
    "mistral": PLAIN,
    "qwen2": PLAIN,
    "qwen3": PLAIN,
    "phi3": PLAIN,
    "gemma": Family(refused_when=_BIDIRECTIONAL),
    "gemma2": Family(logit_softcap="final_logit_softcapping", refused_when=_BIDIRECTIONAL),
    "gemma3_text": Family(logit_softcap="final_logit_softcapping", refused_when=_BIDIRECTIONAL),
    "olmo": PLAIN,
    "olmo2": PLAIN,
    "stablelm": PLAIN,
    "starcoder2": Family(embedding_dropout="embedding_dropout"),
    "cohere": Family(logit_multiplier="logit_scale"),
    "granite": Family(embedding_multiplier="embedding_multiplier", logit_divisor="logits_scaling"),
    "glm4": PLAIN,
    "smollm3": PLAIN,
    "helium": PLAIN,
    "ministral": PLAIN,
    "seed_oss": PLAIN,
    "exaone4": PLAIN,
    # Mixture-of-Experts: the router is found through the model's own output recorders
    "mixtral": PLAIN,
    "qwen2_moe": PLAIN,
    "qwen3_moe": PLAIN,
    "olmoe": PLAIN,
    "phimoe": PLAIN,
    "gpt_oss": PLAIN,
    "deepseek_v3": PLAIN,
    # other layouts
    "phi": Family(layout=Layout(norm="model.final_layernorm", embedding_dropout="model.embed_dropout")),
    "gpt_neox": Family(layout=Layout(embed="gpt_neox.embed_in", layers="gpt_neox.layers", norm="gpt_neox.final_layer_norm",
                                     rotary="gpt_neox.rotary_emb",
                                     embedding_dropout="gpt_neox.emb_dropout")),
    "gpt2": Family(layout=Layout(embed="transformer.wte", positions="transformer.wpe", layers="transformer.h",
                                 norm="transformer.ln_f", rotary=None, embedding_dropout="transformer.drop"),
                   refused_when=(("add_cross_attention", "cross-attention needs encoder states, not a causal LM"),)),
    "falcon": Family(layout=Layout(embed="transformer.word_embeddings", layers="transformer.h", norm="transformer.ln_f",
                                   rotary="transformer.rotary_emb"),
                     layer_kwargs=(("alibi", None),),
                     refused_when=(("alibi", "ALiBi builds its bias from the attention mask inside Model.forward and "
                                             "adds it to the mask; use a rotary Falcon"),)),
}
"""Verified families by ``config.model_type``."""

UNSUPPORTED_FAMILIES: dict[str, str] = {
    "bloom": "ALiBi built from the attention mask inside Model.forward and passed to every block",
    "mpt": "ALiBi built inside Model.forward and passed to every block",
}
"""Families present in transformers that the adapter does not pipeline, with the reason."""


def family_of(model_type: str | None) -> Family | None:
    """The verified entry for ``model_type``, or None when it is not verified."""
    return FAMILIES.get(str(model_type))


def config_value(config: Any, name: str | None, default: Any = None) -> Any:
    """``config.<name>`` (``default`` when the entry names nothing or the config lacks it)."""
    if name is None:
        return default
    value = getattr(config, name, default)
    return default if value is None else value


def refusal_reason(family: Family, config: Any) -> str | None:
    """Why this configuration of a verified family cannot be pipelined, or None."""
    for attribute, reason in family.refused_when:
        if getattr(config, attribute, False):
            return f"config.{attribute}={getattr(config, attribute)!r}: {reason}"
    return None


STATE_SPACE = "a state-space (SSM) model, whose blocks carry a recurrent state instead of attention"
HYBRID = "a hybrid of state-space (SSM) and attention layers of different kinds"
ENCODER_DECODER = "an encoder-decoder model"
VISION_LANGUAGE = "a vision-language model (an image encoder wrapped around a language model)"

UNSUPPORTED_KINDS: dict[str, str] = {
    **{t: STATE_SPACE for t in ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")},
    **{t: HYBRID for t in ("jamba", "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h",
                           "lfm2", "qwen3_next", "recurrent_gemma", "plamo2", "minimax")},
}
"""Layer kinds the causal-LM adapter does not pipeline, by ``config.model_type`` (others are read from
the config: ``is_encoder_decoder``, a ``vision_config``)."""


def unsupported_kind(model_type: str | None, config: Any) -> str | None:
    """What kind of model this is when the causal-LM adapter cannot pipeline its kind (None: it may)."""
    if model_type in FAMILIES:
        return None
    if model_type in UNSUPPORTED_KINDS:
        return UNSUPPORTED_KINDS[str(model_type)]
    if getattr(config, "is_encoder_decoder", False):
        return ENCODER_DECODER
    if getattr(config, "vision_config", None) is not None:
        return VISION_LANGUAGE
    return None


def dynamic_rope_note(layer) -> str | None:
    """For a refused layer holding a Hugging Face rotary embedding with dynamic scaling (``rope_type``
    "dynamic"): what that scaling does and what avoids it, as a sentence; None for any other layer."""
    for module in layer.modules():
        rope_type = getattr(module, "rope_type", None)
        types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        if any(isinstance(t, str) and "dynamic" in t for t in types):
            limit = getattr(module, "original_max_seq_len", None)
            within = f" ({limit} tokens)" if limit else ""
            return ("Its rotary embedding uses dynamic RoPE scaling (rope_type 'dynamic'), which recomputes "
                    "inv_freq in forward whenever a sequence is longer than max_position_embeddings"
                    f"{within}: keep sequences within that length, or configure a static scaling "
                    "(rope_type 'linear', a different model).")
    return None
