"""A ``ModelShape`` read from a local Hugging Face ``config.json``.

``sim plan --model`` takes a preset name, a local model directory or a ``config.json`` path
(``resolve_model_shape``). Configs are read with ``transformers.AutoConfig`` from local files
only (a hub id is refused with the command that fetches the config); ``shape_from_config`` reads
the common fields and each verified MoE family's, and returns what the shape cannot hold as notes
so the caller can say the estimate is approximate. Details: docs/design.md, design notes,
``cost/hf_shape.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .transformer import MODEL_PRESETS, ModelShape, get_model_shape

QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")  # per-head q/k RMSNorm of head_dim (olmo2's spans the projection)


def _first(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` the config sets; a per-layer list (Gemma 3n's ``intermediate_size``) gives its
    largest entry, so the shape prices the widest layer rather than failing."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            value = max(value) if value else None
        if value is not None:
            return value
    return default


def shape_from_config(config: Any, name: str | None = None) -> tuple[ModelShape, list[str]]:
    """The cost-relevant numbers of a ``transformers`` config, and notes on what is approximated."""
    notes: list[str] = []
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = _first(config, "num_key_value_heads", "num_kv_heads")
    if kv_heads is None:
        kv_heads = 1 if getattr(config, "multi_query", False) else heads
    head_dim = int(_first(config, "head_dim", default=hidden // heads))
    intermediate = int(_first(config, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * hidden))
    experts = int(_first(config, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    moe: dict[str, int] = {}
    if experts > 0:
        moe = dict(num_experts=experts,
                   experts_per_token=int(_first(config, "num_experts_per_tok", "num_experts_per_token", default=1)),
                   expert_intermediate=int(_first(config, "moe_intermediate_size", default=intermediate)))
        if _first(config, "n_shared_experts", "shared_expert_intermediate_size"):
            notes.append("shared experts are not modelled (their FLOPs and bytes are left out)")
        if _first(config, "first_k_dense_replace", "mlp_only_layers") or (_first(config, "decoder_sparse_step",
                                                                                   default=1) or 1) > 1:
            notes.append("every layer is costed as MoE (the config's dense layers are not modelled)")
    quantization, quantization_notes = quantization_from_config(config)
    if getattr(config, "kv_lora_rank", None):
        notes.append("multi-head latent attention is costed as plain attention of head_dim "
                     f"{head_dim}")
    shape = ModelShape(
        name=name or getattr(config, "name_or_path", None) or config.model_type,
        hidden=hidden,
        intermediate=intermediate,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        vocab=int(config.vocab_size),
        num_layers=int(config.num_hidden_layers),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qk_norm=config.model_type in QK_NORM_FAMILIES,
        quantization=quantization,
        **moe,
    )
    return shape, notes + quantization_notes


def quantization_from_config(config: Any) -> tuple[str | None, list[str]]:
    """The packed-base scheme a config's ``quantization_config`` names ("nf4" or None), and notes on
    what the planner prices differently from it."""
    q = getattr(config, "quantization_config", None)
    if not q:
        return None, []
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method", "unknown")
    if method == "bitsandbytes" and q.get("load_in_4bit"):
        kind = q.get("bnb_4bit_quant_type", "fp4")  # bitsandbytes' own default
        notes = [] if kind == "nf4" else [f"bitsandbytes {kind} is priced as nf4 (the same packed bytes)"]
        if not q.get("bnb_4bit_use_double_quant", False):
            notes.append("block scales without double quantization (0.5625 B/param) are priced double-quantized "
                         "(0.5159 B/param)")
        return "nf4", notes
    what = "bitsandbytes 8-bit" if method == "bitsandbytes" else f"quantization {method!r}"
    return None, [f"{what} is not priced: the base is priced in the compute dtype"]


def shape_summary(shape: ModelShape) -> str:
    """One line of the numbers read from a config, to check against the model card."""
    text = (f"hidden {shape.hidden}, intermediate {shape.intermediate}, {shape.num_layers} layers, "
            f"{shape.num_heads} heads ({shape.num_kv_heads} kv) of {shape.head_dim}, vocab {shape.vocab}, "
            f"{'tied' if shape.tie_embeddings else 'untied'} embeddings")
    if shape.is_moe:
        text += (f", {shape.num_experts} experts (top-{shape.experts_per_token}) of intermediate "
                 f"{shape.expert_intermediate}")
    if shape.quantization:
        text += f", {shape.quantization} base"
    if shape.lora_targets != "all":
        text += f", LoRA on the {shape.lora_targets} only"
    return text


def hub_refusal(spec: str) -> str:
    """The message for a model argument that is neither a preset nor a local path."""
    return (f"{spec!r} is not a model preset nor a local path, and the planner never downloads. "
            f"Download the config first, e.g. `hf download {spec} config.json --local-dir ./{Path(spec).name}`, "
            f"and pass that folder (or its config.json); presets: {sorted(MODEL_PRESETS)}")


def resolve_model_shape(spec: str | ModelShape) -> tuple[ModelShape, list[str]]:
    """A preset by name, or the shape of a local model directory / ``config.json``, with notes."""
    if isinstance(spec, ModelShape):
        return spec, []
    if spec.lower().replace("_", "-") in MODEL_PRESETS:
        return get_model_shape(spec), []
    path = Path(os.path.expanduser(spec))
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; pass a Hugging Face model directory or its config.json")
    if not path.exists():
        if "/" in spec:  # an owner/name hub id
            raise KeyError(hub_refusal(spec))
        raise KeyError(f"unknown model preset {spec!r}; presets: {sorted(MODEL_PRESETS)}; "
                       f"or pass a local Hugging Face model directory or its config.json")
    from transformers import AutoConfig  # here: presets need no transformers import

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    folder = path if path.is_dir() else path.parent
    return shape_from_config(config, name=folder.resolve().name or config.model_type)
