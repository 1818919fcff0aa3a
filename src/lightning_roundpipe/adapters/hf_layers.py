"""The pipeline layers a Hugging Face causal LM becomes, and the carry that flows between them.

``CausalLMPrefix`` (embedding, rotary position embedding, attention masks), ``DecoderStep`` (one
decoder layer) and ``CausalLMPostfix`` (final norm, head, the chunked loss) hold the model's own
submodules (no copies; the model is never modified). Each takes one *carry* (a flat dict of
tensors, only ``hidden`` and ``moe_probs`` carrying a gradient) and returns the next, so the engine
can run any layer with ``torch.func.functional_call``. ``hf_causal_lm.py`` builds them from a model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..cost.activations import (SDPA_MASK_ELEMENT_BYTES, carry_bytes, decoder_activation_bytes,
                                dense_mask_bytes_per_token, hidden_grad_bytes)
from ..cost.hf_shape import shape_from_config
from .chunked_loss import IDENTITY, LogitTransform, chunked_lm_head_loss
from .input_errors import UnsupportedInputError
from .hf_moe import STAT_KEYS, Router, RouterTap, add_layer_stats, empty_stats, routers_in
from .hf_outputs import slice_positions
from .mask_facts import FACT_KEYS, ROWS_UNPACKED, ROWS_UNPADDED, builder_arguments

Carry = dict[str, Any]


def readable_shape(config):
    """The cost shape of ``config``, or None where the shape reader cannot read it (an unverified family
    with per-layer or unusual fields, e.g. Gemma 4): its layers are then priced by their outputs, as
    for any module, and ``allow_unverified``'s self-check decides whether it runs."""
    try:
        return shape_from_config(config)[0]
    except (TypeError, ValueError, AttributeError, RuntimeError):
        return None


PostfixMode = Literal["auto", "logits", "loss", "loss_and_logits", "loss_and_stats"]

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "labels", "router_stats", "outputs", "with_cache",
              "last_hidden", "logits_to_keep", "loss_scale", *FACT_KEYS)
"""Keys the prefix accepts in a microbatch. ``router_stats`` (bool) asks MoE layers for the
aux-loss statistics; ``outputs`` (a ``PostfixMode``) tells the last layer what to return and
travels with the carry, so a recompute in backward does what its forward did. ``with_cache``
(bool): build the masks as the model's forward does when it holds a (fresh, empty) cache, i.e.
when its effective ``use_cache`` is true (see ``hf_runtime.forward_uses_cache``): HF's mask
builders then do not look for packed sequences in ``position_ids``; without it they do.
``last_hidden`` (bool): the last layer returns the final norm's output too (``hidden_states[-1]``);
``logits_to_keep`` (int or [b, ...] tensor): the positions the head is applied to in logits modes.
``loss_scale`` (float): what the summed loss will be multiplied by (1 / the batch's tokens); the
chunked loss applies it to the logits gradient before rounding it to a low precision, as the
model's mean loss does, so the gradients are those of the scaled loss bit for bit.
``rows_unpadded`` / ``rows_unpacked`` (``HostRows``): what the mask builders would read from the
device, known on the host (``mask_facts``), so layer 0 builds its masks without a device sync."""


PASSED_THROUGH_KEYS = ("labels", "outputs", "last_hidden", "logits_to_keep", "loss_scale")
"""Input keys the prefix hands on unchanged to the last layer."""


DIFFERENTIABLE_CARRY_KEYS = ("hidden", "moe_probs")
"""Carry keys between layers that carry a gradient; all others (cos, sin, masks, ids, labels,
expert counts) depend on no parameter, so the engine need not request gradients for them."""


MASK_KEY_BY_ATTENTION = {"full_attention": "mask", "sliding_attention": "sliding_mask",
                         "chunked_attention": "chunked_mask"}
"""Carry key holding the mask for each kind of attention layer."""

IGNORE_INDEX = -100


def _mask_builders() -> dict[str, Any]:
    """HF's own mask helpers, so the masks equal the unpipelined model's bit for bit."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise ImportError(
            f"the causal-LM adapter needs transformers>=5 (mask helpers take `cache=`); "
            f"found {transformers.__version__}"
        )
    from transformers.masking_utils import (create_causal_mask, create_chunked_causal_mask,
                                            create_sliding_window_causal_mask)

    return {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask,
            "chunked_attention": create_chunked_causal_mask}


def _empty_cache(config: Any):
    """The cache the model's forward creates when ``use_cache`` is on and none is given (only read by the masks)."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


def rotary_keys(layer_type: str | None) -> tuple[str, str]:
    """Carry keys of the rotary (cos, sin) for a layer type (None: one rotary for every layer)."""
    return ("cos", "sin") if layer_type is None else (f"cos.{layer_type}", f"sin.{layer_type}")


class CausalLMPrefix(nn.Module):
    """Token embedding + rotary position embedding + attention masks, once per microbatch.

    Parameters: ``embed_tokens.*``; buffers: ``rotary_emb.*`` (both the model's own modules).
    ``embedding_multiplier`` / ``embedding_dropout``: what the family's ``Model.forward`` does to
    the embeddings (1.0 / 0.0 for most). ``rotary_layer_types``: the layer types to compute a
    rotary embedding for (Gemma3), or None for one shared rotary embedding.
    """

    compiled_on_workers = False  # compile_layers: mask building is data-dependent Python; stays eager

    def __init__(self, embed_tokens: nn.Module, rotary_emb: nn.Module, config: Any, mask_kinds: list[str],
                 embedding_multiplier: float = 1.0, embedding_dropout: float = 0.0,
                 rotary_layer_types: list[str] | None = None, num_experts: int | None = None,
                 positions: nn.Module | None = None, dropout_module: nn.Module | None = None):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb  # None: the family has no rotary embedding
        self.positions = positions  # learned absolute positions (GPT-2), or None
        self.dropout_module = dropout_module  # the model's own embedding dropout module, or None
        # Plain attribute (not a module): read-only, shared with the model.
        self.config = config
        self.mask_kinds = sorted(set(mask_kinds))
        self.embedding_multiplier = float(embedding_multiplier)
        self.embedding_dropout = float(embedding_dropout)
        self.rotary_layer_types = rotary_layer_types
        self.num_experts = num_experts
        self.padded_or_packed = False  # of the first batch (``observe_first_batch``), for the memory estimate

    def dense_mask_bytes_per_token(self, context_tokens: int, dtype_bytes: int) -> int:
        """Per token, the dense masks this prefix puts in the carry for sequences of ``context_tokens``
        (the planner's memory estimate): eager attention gets one additive ``[b, 1, s, s]`` mask per
        attention kind in the compute dtype; sdpa a boolean one per kind whose mask Hugging Face cannot
        skip (``dense_mask_kinds``); other kernels (flash, flex) none that grows with the square."""
        implementation = getattr(self.config, "_attn_implementation", None)
        if implementation == "eager":
            return dense_mask_bytes_per_token(len(self.mask_kinds), context_tokens, dtype_bytes)
        if implementation == "sdpa":
            return dense_mask_bytes_per_token(len(self.dense_mask_kinds(context_tokens)), context_tokens,
                                              SDPA_MASK_ELEMENT_BYTES)
        return 0

    def dense_mask_kinds(self, context_tokens: int) -> list[str]:
        """The attention kinds whose sdpa mask is a dense tensor for sequences of ``context_tokens``: all of them
        when a row of the batch seen (``observe_first_batch``) is padded or packed, else those whose window or
        chunk is shorter than the sequence (Hugging Face skips a plain causal mask, ``is_causal``)."""
        if self.padded_or_packed:
            return list(self.mask_kinds)
        window = {"sliding_attention": getattr(self.config, "sliding_window", None),
                  "chunked_attention": getattr(self.config, "attention_chunk_size", None)}
        return [k for k in self.mask_kinds if isinstance(window.get(k), int) and context_tokens >= window[k]]

    def observe_first_batch(self, carry: Carry) -> None:
        """Note whether the batch the memory estimate is checked against pads or packs a row (dense sdpa masks):
        from the host facts of its rows (``mask_facts``); a mask without them is taken as padded."""
        if not isinstance(carry, dict):
            return
        unpadded, unpacked = carry.get(ROWS_UNPADDED), carry.get(ROWS_UNPACKED)
        padded = (carry.get("attention_mask") is not None and (unpadded is None or not all(unpadded.rows)))
        self.padded_or_packed = padded or (unpacked is not None and not all(unpacked.rows))

    def activation_bytes_per_token(self, dtype_bytes: int) -> dict[str, int]:
        """Per token, the carry it makes (hidden state, rotary, position ids and labels; masks are priced by
        ``dense_mask_bytes_per_token``), all of it new tensors, and the hidden state's gradient."""
        shape = readable_shape(self.config)
        if shape is None:
            return {}
        carry = carry_bytes(shape, dtype_bytes)
        return dict(act_bytes_per_token=carry, graph_bytes_per_token=carry,
                    act_grad_bytes_per_token=hidden_grad_bytes(shape, dtype_bytes))

    def forward(self, carry: Carry) -> Carry:
        unknown = sorted(set(carry) - set(INPUT_KEYS))
        if unknown:
            raise UnsupportedInputError(
                f"CausalLMPrefix got unsupported input keys {unknown}; a microbatch may hold only "
                f"{list(INPUT_KEYS)}. Drop the other keys from the batch before the model call."
            )
        input_ids = carry.get("input_ids")
        if input_ids is None or input_ids.dim() != 2:
            raise UnsupportedInputError(
                "CausalLMPrefix needs 'input_ids' of shape [batch, seq]; got "
                f"{None if input_ids is None else tuple(input_ids.shape)}"
            )
        attention_mask = carry.get("attention_mask")
        position_ids = carry.get("position_ids")
        positions_made = position_ids is None
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        if position_ids is None:
            # As the model does without a cache: plain arange, NOT derived from attention_mask.
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        builders = _mask_builders()
        # The model's forward passes its cache, created empty when use_cache is on, to the mask builders; an empty
        # cache changes no mask size, but it turns off the packed-sequence detection (block-diagonal masks from
        # position_ids that restart mid-row), so the same call must get the same kind of cache here.
        cache = _empty_cache(self.config) if carry.get("with_cache") else None
        # What the builders would read from the device (a sync per mask), answered on the host: mask_facts.
        mask_arg, positions_arg, allow_skip = builder_arguments(carry, attention_mask, position_ids, hidden.shape[1],
                                                                positions_made, cache is not None)
        out: Carry = {}
        for kind in self.mask_kinds:
            out[MASK_KEY_BY_ATTENTION[kind]] = builders[kind](
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=mask_arg,
                cache=cache,
                position_ids=positions_arg,
                allow_is_causal_skip=allow_skip,
            )
        if self.positions is not None:
            hidden = hidden + self.positions(position_ids).to(hidden.device)
        if self.embedding_dropout:
            # The model's train/eval mode, which the embedding module follows (this wrapper is not its child).
            hidden = F.dropout(hidden, p=self.embedding_dropout, training=self.embed_tokens.training)
        if self.dropout_module is not None:
            hidden = self.dropout_module(hidden)
        out["hidden"] = hidden
        if self.rotary_emb is None:
            pass
        elif self.rotary_layer_types is None:
            out["cos"], out["sin"] = self.rotary_emb(hidden, position_ids)
        else:
            for layer_type in self.rotary_layer_types:
                cos_key, sin_key = rotary_keys(layer_type)
                out[cos_key], out[sin_key] = self.rotary_emb(hidden, position_ids, layer_type)
        out["position_ids"] = position_ids
        for key in PASSED_THROUGH_KEYS:
            if carry.get(key) is not None:
                out[key] = carry[key]
        if carry.get("router_stats"):
            if self.num_experts is None:
                raise UnsupportedInputError("router statistics were asked for, but the model has no MoE router")
            out.update(empty_stats(hidden, self.num_experts))
            if attention_mask is not None:
                out["token_mask"] = attention_mask
        return out


@contextlib.contextmanager
def own_checkpointing_off(layer: nn.Module):
    """Run ``layer`` without Hugging Face's gradient checkpointing: the pipeline already
    recomputes every stage from its input in backward, and HF's reentrant checkpoint inside a
    stage would drop the gradients of parameters whose stage input needs none. Subsumed, not
    stacked: exact whatever ``use_reentrant`` the user chose."""
    enabled = getattr(layer, "gradient_checkpointing", False)
    if enabled:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        if enabled:
            layer.gradient_checkpointing = True


def lora_rank_of(layer: nn.Module) -> int | None:
    """The largest LoRA rank of the adapters in ``layer`` (peft's ``lora_A`` projections), or None without one."""
    ranks = [a.out_features for m in layer.modules() if isinstance(getattr(m, "lora_A", None), nn.ModuleDict)
             for a in m.lora_A.values() if isinstance(a, nn.Linear)]
    return max(ranks) if ranks else None


class DecoderStep(nn.Module):
    """One original decoder layer; replaces ``hidden`` and passes every other key through.

    ``rotary_layer_type``: which per-type rotary embedding the layer reads (None: the shared one).
    ``router``: the model's MoE router description; when the carry holds router statistics, the
    layer's router logits are added to them (see ``hf_moe``).
    """

    differentiable_carry_keys = DIFFERENTIABLE_CARRY_KEYS  # read by the engine: what gets a gradient

    def __init__(self, decoder_layer: nn.Module, attention_kind: str, rotary_layer_type: str | None = None,
                 router: Router | None = None, with_rotary: bool = True, extra_kwargs: dict | None = None,
                 config: Any = None):
        super().__init__()
        self.decoder_layer = decoder_layer
        self.config = config  # plain attribute, shared with the model: prices the layer's activations
        self.mask_key = MASK_KEY_BY_ATTENTION[attention_kind]
        self.rotary_key = rotary_keys(rotary_layer_type) if with_rotary else None
        self.extra_kwargs = dict(extra_kwargs or {})
        # Only layers that name position_ids get them (GPT-2's blocks would pass them on to attention).
        self.takes_position_ids = "position_ids" in inspect.signature(decoder_layer.forward).parameters
        self.router = router
        # Plain list, not submodules: the routers are already inside decoder_layer.
        self.routers = routers_in(decoder_layer, router) if router is not None else []

    def activation_bytes_per_token(self, dtype_bytes: int) -> dict[str, int]:
        """Per token, what the layer keeps and passes on (``cost.activations.decoder_activation_bytes`` of the
        model's config; attention scores and masks are priced by the estimate); none without a config."""
        shape = None if self.config is None else readable_shape(self.config)
        if shape is None:
            return {}
        if shape.is_moe and not self.routers:  # a dense layer of an MoE model (Qwen3-MoE's mlp_only_layers)
            shape = dataclasses.replace(shape, num_experts=0, experts_per_token=0, expert_intermediate=0)
        return decoder_activation_bytes(shape, dtype_bytes, lora_rank_of(self.decoder_layer))

    def forward(self, carry: Carry) -> Carry:
        want_stats = bool(self.routers) and STAT_KEYS[0] in carry
        tap = RouterTap(self.routers if want_stats else [], self.router.index if want_stats else 0)
        kwargs = dict(self.extra_kwargs, attention_mask=carry.get(self.mask_key), use_cache=False)
        if self.rotary_key is not None:
            kwargs["position_embeddings"] = (carry[self.rotary_key[0]], carry[self.rotary_key[1]])
        if self.takes_position_ids:
            kwargs["position_ids"] = carry["position_ids"]
        with own_checkpointing_off(self.decoder_layer), tap:
            hidden = self.decoder_layer(carry["hidden"], **kwargs)
        if isinstance(hidden, tuple):  # older transformers returned (hidden, ...)
            hidden = hidden[0]
        out = dict(carry)
        out["hidden"] = hidden
        for logits in tap.logits:
            out.update(add_layer_stats(out, logits, carry.get("token_mask"), self.router))
        return out


class CausalLMPostfix(nn.Module):
    """Final norm + LM head, returning logits or the summed loss of the microbatch.

    What it returns is the carry's ``outputs`` key when present, else ``mode`` (attribute):
        ``"logits"``: ``{"logits": transform(lm_head(norm(hidden)))}`` in the dtype HF returns.
        ``"loss"``: ``{"loss_sum": 0-dim fp32}``, the SUM of token cross-entropies with HF's
        shift (position t predicts label t+1, -100 ignored), via ``chunked_lm_head_loss`` so the
        full [b, s, vocab] logits never exist (memory O(loss_chunk_size x vocab)). Requires
        ``labels`` in the carry. When grad is enabled the head's gradients are computed in the
        same pass (fused last stage).
        ``"loss_and_stats"``: ``{"loss_sum": [1]}`` (chunked) plus the carry's router statistics,
        shaped [1, ...] so microbatches concatenate: an ordinary (not fused) last stage whose
        outputs the host combines (MoE aux loss over the whole batch).
        ``"loss_and_logits"``: as ``"loss_and_stats"`` plus the full logits (the user asked for them).
        ``"auto"`` (default): ``"loss"`` when the carry holds labels, else ``"logits"``.
    Router statistics in the carry are returned with the logits as well (``[1, E]``, ``[1]``).
    A carry with ``last_hidden`` also returns ``{"last_hidden": norm(hidden)}`` (not in the fused
    ``"loss"`` mode, whose only output is the scalar); ``logits_to_keep`` in the carry restricts the
    logits to those positions (logits mode), as transformers' ``slice_logits_to_keep`` does.
    ``transform``: the family's logit scaling / soft-capping (identity for most).
    ``head_dropout``: the model's dropout before a token classifier (``...ForTokenClassification``), or None.
    ``loss_chunk_size``: rows of logits computed at a time in loss mode.

    A non-``nn.Linear`` lm_head (e.g. peft-wrapped) falls back to full logits + plain
    cross-entropy: still exact, but without the memory bound (see ``uses_chunked_loss``).
    """

    compiled_on_workers = False  # compile_layers: the chunked loss is a loop of autograd Functions; stays eager

    differentiable_carry_keys = DIFFERENTIABLE_CARRY_KEYS  # read by the engine: what gets a gradient

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Module,
        mode: PostfixMode = "auto",
        loss_chunk_size: int = 1024,
        ignore_index: int = IGNORE_INDEX,
        transform: LogitTransform = IDENTITY,
        head_dropout: nn.Module | None = None,
    ):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.head_dropout = head_dropout
        self.mode = mode
        self.loss_chunk_size = loss_chunk_size
        self.ignore_index = ignore_index
        self.transform = transform

    @property
    def uses_chunked_loss(self) -> bool:
        """True when loss mode uses the chunked head (lm_head is a plain nn.Linear)."""
        return type(self.lm_head) is nn.Linear

    def forward(self, carry: Carry) -> Carry:
        mode = carry.get("outputs") or self.mode
        if mode == "auto":
            mode = "loss" if carry.get("labels") is not None else "logits"
        if mode not in ("logits", "loss", "loss_and_logits", "loss_and_stats"):
            raise ValueError(f"CausalLMPostfix.mode must be 'auto', 'logits', 'loss', 'loss_and_logits' or "
                             f"'loss_and_stats', got {mode!r}")
        hidden = self.norm(carry["hidden"])
        # returned with every output but the fused scalar: router statistics, the last hidden state when asked
        extra = {k: carry[k].reshape(1, *carry[k].shape) for k in STAT_KEYS if k in carry}
        if carry.get("last_hidden"):
            extra["last_hidden"] = hidden
        if mode == "logits":
            keep = carry.get("logits_to_keep")
            return {"logits": self._logits(hidden if keep is None else slice_positions(hidden, keep)), **extra}
        labels = carry.get("labels")
        if labels is None:
            raise UnsupportedInputError("CausalLMPostfix in loss mode needs 'labels' in the microbatch")
        if mode == "loss_and_logits":
            logits = self._logits(hidden)
            loss_sum = self._loss_from_logits(logits, labels)
            return {"loss_sum": loss_sum.reshape(1), "logits": logits, **extra}
        loss_sum = self._loss(hidden, labels, carry.get("loss_scale"))
        if mode == "loss":
            if "last_hidden" in extra:
                raise ValueError("CausalLMPostfix in the fused 'loss' mode returns only the loss; ask for the last "
                                 "hidden state in 'loss_and_stats' mode")
            return {"loss_sum": loss_sum}
        return {"loss_sum": loss_sum.reshape(1), **extra}

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_dropout is not None:
            hidden = self.head_dropout(hidden)
        return self.transform(self.lm_head(hidden))

    def _shifted(self, labels: torch.Tensor, device) -> torch.Tensor:
        # HF's shift: pad one ignored label at the end, drop the first (keeps hidden a view).
        return F.pad(labels.to(device), (0, 1), value=self.ignore_index)[..., 1:].reshape(-1)

    def _loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets = self._shifted(labels, logits.device)
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, targets, ignore_index=self.ignore_index, reduction="sum")

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor, grad_scale: float | None = None) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        targets = self._shifted(labels, hidden.device)
        if self.uses_chunked_loss:
            return chunked_lm_head_loss(
                rows,
                self.lm_head.weight,
                targets,
                chunk_size=self.loss_chunk_size,
                ignore_index=self.ignore_index,
                bias=self.lm_head.bias,
                transform=self.transform,
                grad_scale=grad_scale,
            )
        logits = self.transform(self.lm_head(rows)).float()
        return F.cross_entropy(logits, targets, ignore_index=self.ignore_index, reduction="sum")
