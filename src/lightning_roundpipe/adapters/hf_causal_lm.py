"""Hugging Face decoder-only causal LMs as a sequence of pipeline layers.

``CausalLMLayers.from_model(model).layers`` is ``[CausalLMPrefix, DecoderStep x N, CausalLMPostfix]``
(``hf_layers.py``), built after checking the model's family, head and layout. The loss is
``sum(loss_sum over microbatches) / count_loss_tokens(labels of the whole batch)``, exactly HF's
mean. The carry's keys, layer by layer: docs/design.md, design notes, ``adapters/hf_causal_lm.py``;
each family's modules and forward: ``hf_families``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .chunked_loss import IDENTITY, LogitTransform
from .hf_families import FAMILIES, UNSUPPORTED_FAMILIES, config_value, family_of, refusal_reason
from .hf_moe import Router, find_router
from .hf_layers import (IGNORE_INDEX, MASK_KEY_BY_ATTENTION, Carry, CausalLMPostfix, CausalLMPrefix, DecoderStep,
                        PostfixMode)


VERIFIED_MODEL_TYPES = frozenset(FAMILIES)
"""``config.model_type`` values whose HF forward each has a parity test (tests/adapters/test_family_parity.py);
see ``hf_families`` for what each family's forward adds."""

HEAD_KINDS = ("causal_lm", "sequence_classification", "token_classification")
"""What the model's head is: the LM head (``lm_head``) or a classifier (``score``) of transformers'
``GenericFor{Sequence,Token}Classification``."""


def unwrap_peft(model: nn.Module) -> nn.Module:
    """Return the Hugging Face model inside a peft wrapper (``PeftModel.base_model.model``).

    Models that are not peft-wrapped are returned unchanged. peft is optional.
    """
    try:
        from peft import PeftModel
    except ImportError:  # peft not installed: nothing can be peft-wrapped
        return model
    while isinstance(model, PeftModel):
        model = model.get_base_model()
    return model


def count_loss_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Number of tokens HF's causal-LM loss averages over: shifted labels != ignore_index.

    Args:
        labels: [b, s] labels of the WHOLE batch (not one microbatch).
        ignore_index: label value that is skipped.
    """
    return int((labels[..., 1:] != ignore_index).sum().item())


def attention_kinds(config: Any, num_layers: int) -> list[str]:
    """Per decoder layer, which mask it uses: ``"full_attention"``, ``"sliding_attention"`` or ``"chunked_attention"``.

    Mirrors the models: ``config.layer_types`` when the config has it (Qwen2/Qwen3, Gemma2/3...),
    otherwise sliding for every layer when ``config.sliding_window`` is set (Mistral, Phi3,
    Starcoder2, Mixtral), else full (Llama).
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        kinds = list(layer_types[:num_layers])
    elif getattr(config, "sliding_window", None) is not None:
        kinds = ["sliding_attention"] * num_layers
    else:
        kinds = ["full_attention"] * num_layers
    unknown = sorted(set(kinds) - set(MASK_KEY_BY_ATTENTION))
    if unknown:
        raise UnsupportedModelError(
            f"config.layer_types contains {unknown}; this adapter supports only "
            f"{sorted(MASK_KEY_BY_ATTENTION)}."
        )
    return kinds


def rotary_takes_layer_type(rotary_emb: nn.Module) -> bool:
    """True when the rotary module computes one embedding per layer type (Gemma3: ``forward(x, pos, layer_type)``)."""
    return "layer_type" in inspect.signature(rotary_emb.forward).parameters


def head_kind(model: nn.Module) -> str:
    """Which of ``HEAD_KINDS`` the model's head is (``"causal_lm"`` for anything but transformers' generic
    sequence / token classifiers, whose ``forward`` is the base model, then ``score`` on its last hidden state)."""
    try:
        from transformers.modeling_layers import GenericForSequenceClassification, GenericForTokenClassification
    except ImportError:  # older transformers: every family wrote its own classifier
        return "causal_lm"
    if isinstance(model, GenericForSequenceClassification):
        return "sequence_classification"
    if isinstance(model, GenericForTokenClassification):
        return "token_classification"
    return "causal_lm"


def _head_paths(head: str, layout: Any) -> tuple[str, str | None]:
    """(head module path, dropout-before-head path or None) for a head kind, from the ``...For*`` model."""
    if head == "causal_lm":
        return layout.head, None
    return "score", "dropout" if head == "token_classification" else None


def _require(obj: Any, path: str, model_class: str) -> Any:
    """Follow a dotted attribute path, raising UnsupportedModelError at the first missing part."""
    current = obj
    walked = "model"
    for part in path.split(".")[1:]:
        walked = f"{walked}.{part}"
        if not hasattr(current, part):
            raise UnsupportedModelError(
                f"{model_class} has no attribute '{walked}', which the Hugging Face causal-LM "
                "adapter needs (for its model_type: see lightning_roundpipe/adapters/hf_families.py; "
                "Llama's layout is model.model.embed_tokens, .layers, .norm, .rotary_emb, model.lm_head). "
                "Use a supported family (docs/models.md) or pipeline an nn.Sequential of its layers."
            )
        current = getattr(current, part)
    return current


@dataclass
class CausalLMLayers:
    """A Hugging Face causal LM seen as ``[CausalLMPrefix, DecoderStep x N, CausalLMPostfix]``.

    Attributes:
        layers: the pipeline layers, each ``forward(carry) -> carry``.
        model: the unwrapped HF model the layers reference (never modified).
        model_type: ``config.model_type``.
    """

    layers: list[nn.Module]
    model: nn.Module
    model_type: str

    router: Router | None = None
    verified: bool = True
    head: str = "causal_lm"  # one of HEAD_KINDS

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        *,
        postfix_mode: PostfixMode = "auto",
        loss_chunk_size: int = 1024,
        allow_unverified: bool = False,
    ) -> "CausalLMLayers":
        """Build the layers of a HF causal LM (or a peft-wrapped one).

        Args:
            model: e.g. ``LlamaForCausalLM``, or ``peft.get_peft_model(...)`` of one.
            postfix_mode: initial ``CausalLMPostfix.mode``.
            loss_chunk_size: initial ``CausalLMPostfix.loss_chunk_size``.
            allow_unverified: accept a model whose structure matches but whose ``model_type`` is
                not in ``VERIFIED_MODEL_TYPES``; ``verified`` is then False and the caller must
                check parity before training (the runtime does, on the first microbatch).

        Raises:
            UnsupportedModelError: a required attribute is missing (named in the message), the
                layers container is not an ``nn.ModuleList``, the family is known not to fit, or
                the model type is unverified.
        """
        hf_model = unwrap_peft(model)
        model_class = type(hf_model).__name__
        config = _require(hf_model, "model.config", model_class)
        model_type = getattr(config, "model_type", None)
        if model_type in UNSUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"{model_class} (model_type={model_type!r}) cannot be pipelined by the causal-LM adapter: "
                f"{UNSUPPORTED_FAMILIES[model_type]}. Train it with another strategy, or wrap its blocks in an "
                "nn.Sequential and pipeline that."
            )
        family = family_of(model_type)
        reason = refusal_reason(family, config) if family is not None else None
        if reason is not None:
            raise UnsupportedModelError(f"{model_class} cannot be pipelined as a causal LM: {reason}")
        spec = family or FAMILIES["llama"]
        layout = spec.layout
        head = head_kind(hf_model)
        if head != "causal_lm" and family is None:
            raise UnsupportedModelError(
                f"{model_class} (model_type={model_type!r}) is a classifier of a family that is not verified; "
                "RoundPipe pipelines the sequence / token classification heads of the verified families "
                f"{sorted(VERIFIED_MODEL_TYPES)} only."
            )
        head_path, head_dropout_path = _head_paths(head, layout)
        if head == "causal_lm" and not hasattr(hf_model, head_path.split(".")[0]) and hasattr(hf_model, "score"):
            raise UnsupportedModelError(
                f"{model_class} is a classifier with its own forward, which RoundPipe does not pipeline: it "
                "pipelines the causal LMs of the verified families and their ...ForSequenceClassification / "
                "...ForTokenClassification built on transformers' GenericFor{Sequence,Token}Classification "
                "(Llama, Qwen3, Mistral, ...). "
                "Train this one with another strategy."
            )
        embed_tokens = _require(hf_model, f"model.{layout.embed}", model_class)
        decoder_layers = _require(hf_model, f"model.{layout.layers}", model_class)
        norm = _require(hf_model, f"model.{layout.norm}", model_class)
        rotary_emb = _require(hf_model, f"model.{layout.rotary}", model_class) if layout.rotary else None
        lm_head = _require(hf_model, f"model.{head_path}", model_class)
        head_dropout = _require(hf_model, f"model.{head_dropout_path}", model_class) if head_dropout_path else None
        positions = _require(hf_model, f"model.{layout.positions}", model_class) if layout.positions else None
        dropout = (_require(hf_model, f"model.{layout.embedding_dropout}", model_class)
                   if layout.embedding_dropout else None)
        if not isinstance(decoder_layers, nn.ModuleList):
            raise UnsupportedModelError(
                f"{model_class}.{layout.layers} is a {type(decoder_layers).__name__}, not an "
                "nn.ModuleList; pass the module to pipeline by name instead."
            )
        if family is None and not allow_unverified:
            raise UnsupportedModelError(
                f"{model_class} (model_type={model_type!r}) has the expected attributes, but its forward is not "
                f"among the verified families {sorted(VERIFIED_MODEL_TYPES)} (it may scale embeddings or logits "
                "inside forward). Pass RoundPipeStrategy(allow_unverified=True) (plain PyTorch: "
                "RoundPipeRuntime.attach(..., options=RuntimeOptions(allow_unverified=True))) to run it after a "
                "parity check of the pipelined against the unpipelined forward on the first microbatch."
            )
        num_layers = min(len(decoder_layers), getattr(config, "num_hidden_layers", len(decoder_layers)))
        kinds = attention_kinds(config, num_layers)
        per_type_rotary = rotary_emb is not None and rotary_takes_layer_type(rotary_emb)
        router = find_router(hf_model)
        prefix = CausalLMPrefix(
            embed_tokens, rotary_emb, config, kinds,
            embedding_multiplier=float(config_value(config, spec.embedding_multiplier, 1.0)),
            embedding_dropout=float(config_value(config, spec.embedding_dropout, 0.0)),
            rotary_layer_types=sorted(set(kinds)) if per_type_rotary else None,
            num_experts=router.num_experts if router is not None else None,
            positions=positions, dropout_module=dropout,
        )
        transform = IDENTITY if head != "causal_lm" else LogitTransform(  # a classifier's forward scales nothing
            multiplier=float(config_value(config, spec.logit_multiplier, 1.0)),
            divisor=float(config_value(config, spec.logit_divisor, 1.0)),
            softcap=None if spec.logit_softcap is None else config_value(config, spec.logit_softcap, None),
        )
        layers: list[nn.Module] = [prefix]
        layers += [DecoderStep(decoder_layers[i], kinds[i], kinds[i] if per_type_rotary else None, router,
                               with_rotary=rotary_emb is not None, extra_kwargs=dict(spec.layer_kwargs), config=config)
                   for i in range(num_layers)]
        layers.append(CausalLMPostfix(norm, lm_head, mode=postfix_mode, loss_chunk_size=loss_chunk_size,
                                      transform=transform, head_dropout=head_dropout))
        return cls(layers=layers, model=hf_model, model_type=str(model_type), router=router,
                   verified=family is not None, head=head)

    @property
    def num_decoder_layers(self) -> int:
        """How many decoder layers the model's forward runs (its ``hidden_states`` has one more entry)."""
        return len(self.layers) - 2

    @property
    def prefix(self) -> CausalLMPrefix:
        """The first layer (embedding, rotary, masks)."""
        return self.layers[0]

    @property
    def postfix(self) -> CausalLMPostfix:
        """The last layer (norm, LM head, optional loss)."""
        return self.layers[-1]

    def set_postfix_mode(self, mode: PostfixMode) -> None:
        """Choose what the last layer returns: ``"logits"``, ``"loss"`` or ``"auto"``."""
        if mode not in ("auto", "logits", "loss", "loss_and_logits", "loss_and_stats"):
            raise ValueError(f"postfix mode must be 'auto', 'logits', 'loss', 'loss_and_logits' or 'loss_and_stats', "
                             f"got {mode!r}")
        self.postfix.mode = mode

    @property
    def is_moe(self) -> bool:
        """True when the model has an MoE router the adapter found."""
        return self.router is not None

    def run(self, carry: Carry) -> Carry:
        """Run all layers in order on one microbatch (reference / debugging path)."""
        for layer in self.layers:
            carry = layer(carry)
        return carry

    def shared_parameters(self) -> list[list[tuple[int, str]]]:
        """Parameters that appear in more than one layer (tied embeddings: the prefix's
        ``embed_tokens.weight`` is the postfix's ``lm_head.weight``), as groups of
        ``(layer_index, parameter_name)``; their gradients must be summed across layers."""
        owners: dict[int, list[tuple[int, str]]] = {}
        for index, layer in enumerate(self.layers):
            for name, param in layer.named_parameters(remove_duplicate=False):
                owners.setdefault(id(param), []).append((index, name))
        return [group for group in owners.values() if len({i for i, _ in group}) > 1]
