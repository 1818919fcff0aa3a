"""What each Hugging Face decoder family's own ``forward`` does beyond embed -> layers -> norm -> head.

The adapter derives what it can from the model's modules: scaled embeddings live in the
embedding module (Gemma), residual and attention multipliers and attention soft-capping live in
the decoder layers (Granite, Gemma2), a rotary module whose ``forward`` takes ``layer_type``
means one rotary embedding per layer type (Gemma3), a ``router_logits`` output recorder in
``_can_record_outputs`` names the MoE router. What remains is written in ``ForCausalLM.forward``
or ``Model.forward`` as arithmetic on config values; it is declared here, one small entry per
family, each backed by a parity test (tests/test_family_parity.py).

A family missing from ``FAMILIES`` is *unverified*: refused unless the user passes
``allow_unverified=True``, which runs a parity check on the first microbatch first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """The config-driven arithmetic of one family's ``forward`` (attribute names on its config).

    embedding_multiplier: the model multiplies the token embeddings by this (Granite).
    embedding_dropout: dropout probability applied to the embeddings in ``Model.forward`` (Starcoder2).
    logit_multiplier: logits are multiplied by this (Cohere's ``logit_scale``).
    logit_divisor: logits are divided by this (Granite's ``logits_scaling``).
    logit_softcap: ``cap * tanh(logits / cap)`` when the value is not None (Gemma2, Gemma3).
    refused_when: (config attribute, reason) pairs: a truthy value makes the model unsupported.
    """

    embedding_multiplier: str | None = None
    embedding_dropout: str | None = None
    logit_multiplier: str | None = None
    logit_divisor: str | None = None
    logit_softcap: str | None = None
    refused_when: tuple[tuple[str, str], ...] = ()


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
}
"""Verified families by ``config.model_type``."""

UNSUPPORTED_FAMILIES: dict[str, str] = {
    "gpt2": "learned absolute positions and blocks under model.transformer.h that take no position embeddings; "
            "its forward is not the embed -> rotary -> layers -> norm -> head shape this adapter reproduces",
    "gpt_neox": "modules live under model.gpt_neox (embed_in, final_layer_norm) and the head is embed_out",
    "falcon": "modules live under model.transformer (word_embeddings, h, ln_f) and ALiBi builds its bias from "
              "the attention mask inside Model.forward",
    "phi": "the final norm is model.model.final_layernorm and the embeddings go through embed_dropout",
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
