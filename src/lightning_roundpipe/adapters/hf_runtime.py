"""The pipelined ``forward`` of a Hugging Face causal LM (plain or peft-wrapped).

Takes the arguments users pass in a training step (``input_ids``, ``attention_mask``,
``position_ids``, ``labels``, ``output_router_logits``) and returns the output class the model
would. With labels the loss is fused into the last stage and only scalars come home (exactly
HF's mean; ``.logits`` then raises unless ``logits_with_loss``); MoE router losses are formed on
the host from batch totals; generation and cache calls run the model's own forward on the host.
Every case, and why: docs/design.md, design notes, ``adapters/hf_runtime.py``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch
from torch import nn

from ..errors import LogitsNotComputedError
from .grouped_experts import install_grouped_experts
from .hf_causal_lm import CausalLMLayers, UnsupportedModelError, count_loss_tokens, unwrap_peft
from .hf_moe import aux_loss
from .input_errors import UnsupportedInputError
from .hf_self_check import build_layers, check_unverified
from .mask_facts import host_facts
from .unpipelined_calls import CACHE_GIVEN, USE_CACHE, UnpipelinedNotice
from .hf_outputs import (forward_uses_cache, hidden_states_output, hidden_states_request, logits_to_keep_for_batch,
                         pooled_logits, refuse_attentions)

log = logging.getLogger(__name__)

_IGNORED_KWARGS = {"return_dict", "cache_position"}

WITHHELD_LOGITS = (
    "the RoundPipe pipeline computed this loss inside its last stage, chunk by chunk, and never built the full "
    "logits. To get them with the loss, pass RoundPipeStrategy(logits_with_loss=True) (plain PyTorch: "
    "RuntimeOptions(logits_with_loss=True)); it costs one full [batch, seq, vocab] logits tensor. Or call the model "
    "again without labels under torch.no_grad() for the logits alone."
)


def _withheld_class(output_class: type) -> type:
    """``output_class`` whose ``.logits`` raises ``LogitsNotComputedError`` instead of returning None."""
    cached = _WITHHELD.get(output_class)
    if cached is None:
        def __getattribute__(self, name):
            if name == "logits":
                raise LogitsNotComputedError(WITHHELD_LOGITS)
            return output_class.__getattribute__(self, name)

        cached = type(f"{output_class.__name__}WithoutLogits", (output_class,), {"__getattribute__": __getattribute__})
        _WITHHELD[output_class] = cached
    return cached


_WITHHELD: dict[type, type] = {}


def causal_lm_runtime_parts(module: nn.Module, options: Any = None) -> tuple[nn.Module, list[nn.Module], Callable]:
    """(module whose forward is patched, layers, forward factory) for a causal LM.

    ``options``: the runtime's options; reads ``allow_unverified``, ``logits_with_loss`` and ``moe_experts``
    when present (``moe_experts="grouped"`` or ``"padded_bmm"`` swaps the experts' forward when the runtime
    patches the model; ``adapters/grouped_experts.py``).
    """
    allow_unverified = bool(getattr(options, "allow_unverified", False))
    logits_with_loss = bool(getattr(options, "logits_with_loss", False))
    experts_path = getattr(options, "moe_experts", "hf")
    grouped_experts = experts_path in ("grouped", "padded_bmm")
    kernel = "padded_bmm" if experts_path == "padded_bmm" else "grouped_mm"
    adapter = build_layers(module, lambda: CausalLMLayers.from_model(module, allow_unverified=allow_unverified),
                           allow_unverified)
    inner = unwrap_peft(module)
    override = forward_override(type(inner))
    if override is not None and not allow_unverified:
        raise UnsupportedModelError(
            f"{override.__module__}.{override.__qualname__} overrides forward of the Hugging Face model, which RoundPipe "
            f"does not run: it pipelines the family's own forward, so what the override adds (an extra loss term, a "
            f"changed output) would be silently dropped. Compute the extra term in training_step from the model's "
            f"outputs (RoundPipeStrategy(logits_with_loss=True) returns the logits with the loss), or pass "
            f"RoundPipeStrategy(allow_unverified=True) to run it only if the pipeline matches the override's own "
            f"forward on the first microbatch. No weight was changed.")
    unpipelined_forward = type(inner).forward
    forward_parameters = inspect.signature(unpipelined_forward).parameters
    keep_option = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in forward_parameters), None)

    def make_forward(runtime) -> Callable:
        if grouped_experts and not adapter.verified:
            # the self-check compares with the unpipelined model, which would run the same swapped experts
            log.warning("moe_experts=%r: %s is not a verified family; its experts keep Hugging Face's forward",
                        experts_path, type(inner).__name__)
        elif grouped_experts:  # undone by target.unpatch when the runtime detaches
            _, kept = install_grouped_experts(inner, kernel)
            if kept:
                log.warning("moe_experts=%r: %s keep Hugging Face's experts forward (their layout is not mapped)",
                            experts_path, ", ".join(kept))
        forward = PipelinedCausalLMForward(runtime, adapter, inner, unpipelined_forward, keep_option, logits_with_loss)
        forward.pending_check = forward.pending_check or override is not None  # checked against the override
        return forward

    return inner, adapter.layers, make_forward


class PipelinedCausalLMForward:
    """The patched ``forward`` of a causal LM (or sequence / token classifier): reads the call's options
    (every one before anything runs, so a refused one changes nothing), builds the pipeline's batch,
    runs it, and returns what the model's own forward would (see the module doc)."""

    def __init__(self, runtime, adapter: CausalLMLayers, inner: nn.Module, unpipelined_forward: Callable,
                 keep_option: str | None, logits_with_loss: bool) -> None:
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

        self.runtime, self.adapter, self.inner = runtime, adapter, inner
        self.unpipelined_forward = unpipelined_forward
        # The positions option this model's forward reads (transformers 5: logits_to_keep); a name its signature
        # lacks falls into **kwargs there and is ignored, so it is ignored here too. A classifier keeps every position.
        self.keep_option = keep_option
        self.logits_with_loss = logits_with_loss
        self.router = adapter.router
        self.base_model = inner.base_model  # the module whose forward builds the masks (its use_cache decides how)
        self.output_class = MoeCausalLMOutputWithPast if self.router is not None else CausalLMOutputWithPast
        self.pending_check = not adapter.verified
        self.notice = UnpipelinedNotice()

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, past_key_values=None,
                 inputs_embeds=None, cache=None, use_cache=None, output_router_logits=None, **kwargs: Any):
        if use_cache or cache is not None or past_key_values is not None:
            # model.generate(): the model's own forward on the host, with the real (current) weights.
            self.notice.training_call(self.inner, USE_CACHE if use_cache and cache is None and past_key_values is None
                                      else CACHE_GIVEN)
            self.runtime.join()
            return self.unpipelined_forward(self.inner, input_ids=input_ids, attention_mask=attention_mask,
                                            position_ids=position_ids, labels=labels, inputs_embeds=inputs_embeds,
                                            cache=cache if cache is not None else past_key_values,
                                            use_cache=use_cache, **kwargs)
        if inputs_embeds is not None or input_ids is None:
            raise UnsupportedInputError("the RoundPipe pipeline of a causal LM takes input_ids (inputs_embeds is not supported)")
        hidden_request, num_items_in_batch, keep = self.read_options(input_ids, labels, kwargs)
        batch = self.batch(input_ids, attention_mask, position_ids, labels, use_cache, hidden_request, keep)
        tokens = int(input_ids.numel())
        if self.adapter.head != "causal_lm":
            batch["outputs"] = "logits"
            out = self.runtime.run(batch, tokens=tokens)
            return classifier_output(self.adapter.head, self.inner, input_ids, labels, out["logits"],
                                     self.hidden_states(hidden_request, out))
        if output_router_logits is None:
            output_router_logits = bool(getattr(self.inner.config, "output_router_logits", False))
        with_stats = self.router is not None and bool(output_router_logits)
        if with_stats:
            batch["router_stats"] = True
        if labels is None:
            return self.logits_output(batch, tokens, with_stats, hidden_request)
        if labels.shape != input_ids.shape:
            raise UnsupportedInputError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        own_loss = user_loss_function(self.inner)
        if own_loss is not None:
            return self.user_loss_output(batch, tokens, with_stats, hidden_request, labels, num_items_in_batch, own_loss)
        batch["labels"] = labels
        return self.loss_output(batch, tokens, with_stats, hidden_request, loss_scale(labels, num_items_in_batch))

    def read_options(self, input_ids: torch.Tensor, labels, kwargs: dict):
        """(hidden-state request, ``num_items_in_batch``, kept logit positions) from the call's keywords;
        refuses what the pipeline cannot return, and keywords it does not know."""
        adapter, config = self.adapter, self.inner.config
        hidden_request = hidden_states_request(kwargs.pop("output_hidden_states", None), config,
                                               adapter.num_decoder_layers)
        refuse_attentions(kwargs.pop("output_attentions", None), config)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        keep = {name: kwargs.pop(name) for name in ("logits_to_keep", "num_logits_to_keep") if name in kwargs}
        keep = logits_to_keep_for_batch(keep.get(self.keep_option, 0), int(input_ids.shape[0]))
        unknown = sorted(set(kwargs) - _IGNORED_KWARGS)
        if unknown:
            raise UnsupportedInputError(f"the RoundPipe pipeline of a causal LM does not take {unknown}")
        if keep is not None and labels is not None:
            raise UnsupportedInputError(f"the RoundPipe pipeline takes {self.keep_option} without labels only (the model's loss "
                             f"would compare the kept positions' logits with every label); pass one or the other")
        return hidden_request, num_items_in_batch, keep

    def batch(self, input_ids, attention_mask, position_ids, labels, use_cache, hidden_request, keep) -> dict:
        """The pipeline's batch (after the unverified family's self-check on the first call)."""
        batch = {"input_ids": input_ids}
        if attention_mask is not None:
            batch["attention_mask"] = attention_mask
        if position_ids is not None:
            batch["position_ids"] = position_ids.expand(input_ids.shape[0], -1) if position_ids.shape[0] == 1 else position_ids
        if self.pending_check:
            check_unverified(int(self.runtime.options.microbatches or self.runtime.num_workers + 1), self.inner,
                             self.adapter, batch, labels)
            self.pending_check = False
        batch.update(host_facts(attention_mask, batch.get("position_ids")))  # layer 0's masks then read no device value
        if forward_uses_cache(self.base_model, use_cache):
            batch["with_cache"] = True  # the same masks as the model's forward, which would hold a fresh cache
        if hidden_request is not None:
            batch["last_hidden"] = True
        if keep is not None:
            batch["logits_to_keep"] = keep
        return batch

    def hidden_states(self, hidden_request, out: dict):
        """The output's ``hidden_states`` (only the last one, when asked for)."""
        return hidden_states_output(hidden_request, out.get("last_hidden"), self.adapter.num_decoder_layers)

    def logits_output(self, batch: dict, tokens: int, with_stats: bool, hidden_request):
        """Run a call without labels: the model's output with its logits (and aux loss)."""
        batch["outputs"] = "logits"
        out = self.runtime.run(batch, tokens=tokens)
        aux = self.aux(out) if with_stats else None
        return self.output_class(loss=None, logits=out["logits"], hidden_states=self.hidden_states(hidden_request, out),
                                 **({"aux_loss": aux} if self.router is not None else {}))

    def loss_output(self, batch: dict, tokens: int, with_stats: bool, hidden_request, scale: float):
        """Run a call with labels: the fused loss, or the last stage's loss sums combined on the host."""
        moe = {"aux_loss": None} if self.router is not None else {}
        batch["loss_scale"] = scale  # the chunked loss scales the logits gradient before rounding it
        if not with_stats and not self.logits_with_loss and hidden_request is None:
            batch["outputs"] = "loss"
            loss = self.runtime.run(batch, loss_scale=scale, tokens=tokens)
            return _withheld_class(self.output_class)(loss=loss, logits=None, **moe)
        # An ordinary last stage: its outputs are combined on the host, then backward runs through them.
        batch["outputs"] = "loss_and_logits" if self.logits_with_loss else "loss_and_stats"
        out = self.runtime.run(batch, tokens=tokens)
        loss = out["loss_sum"].sum() * scale
        if with_stats:
            moe["aux_loss"] = self.aux(out)
            if self.router.coefficient is not None:
                loss = loss + self.router.coefficient * moe["aux_loss"]
        hidden = self.hidden_states(hidden_request, out)
        if self.logits_with_loss:
            return self.output_class(loss=loss, logits=out["logits"], **moe, hidden_states=hidden)
        return _withheld_class(self.output_class)(loss=loss, logits=None, **moe, hidden_states=hidden)

    def user_loss_output(self, batch: dict, tokens: int, with_stats: bool, hidden_request, labels: torch.Tensor,
                         num_items_in_batch: Any, loss_function: Callable):
        """Run a call with labels whose model has a loss of the user's own: the full logits come home and
        ``loss_function`` runs on them with the arguments the model's forward passes it."""
        batch["outputs"] = "logits"
        out = self.runtime.run(batch, tokens=tokens)
        extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
        loss = loss_function(logits=out["logits"], labels=labels, vocab_size=self.inner.config.vocab_size, **extra)
        moe = {"aux_loss": None} if self.router is not None else {}
        if with_stats:
            moe["aux_loss"] = self.aux(out)
            if self.router.coefficient is not None:
                loss = loss + self.router.coefficient * moe["aux_loss"].to(loss.device)
        return self.output_class(loss=loss, logits=out["logits"], hidden_states=self.hidden_states(hidden_request, out),
                                 **moe)

    def aux(self, out) -> torch.Tensor:
        """HF's load-balancing loss from the batch's router statistics."""
        return aux_loss(out["moe_counts"].sum(0), out["moe_probs"].sum(0), out["moe_rows"].sum(),
                        self.router.num_experts)


def forward_override(model_class: type) -> type | None:
    """The class outside transformers whose ``forward`` the model's class runs instead of its family's, if any."""
    for cls in model_class.__mro__:
        if "forward" in vars(cls):
            return None if cls.__module__.startswith("transformers.") else cls
    return None


def user_loss_function(model: nn.Module) -> Callable | None:
    """The model's ``loss_function`` when it is not HF's causal-LM loss (the user replaced it), else None."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    fn = vars(model).get("_loss_function")  # where HF's setter keeps an assigned loss_function
    if fn is None:
        owner = next((cls for cls in type(model).__mro__ if "loss_function" in vars(cls)), None)
        if owner is None or owner.__module__.startswith("transformers."):
            return None  # HF's own property (read here it would log HF's loss_type notice a second time)
        fn = model.loss_function  # a subclass's own
    return None if fn is ForCausalLMLoss else fn


def loss_scale(labels: torch.Tensor, num_items_in_batch: Any = None) -> float:
    """What the summed token losses are multiplied by: 1 / ``num_items_in_batch`` when given (HF then sums and
    divides by it, to normalise over gradient-accumulation steps), else 1 / the batch's counted tokens (HF's mean)."""
    if num_items_in_batch is not None:
        items = float(num_items_in_batch)
        return 1.0 / items if items else float("nan")
    count = count_loss_tokens(labels)
    return 1.0 / count if count > 0 else float("nan")


def classifier_output(head: str, model: nn.Module, input_ids: torch.Tensor, labels: Any, logits: torch.Tensor,
                      hidden_states: Any):
    """The output of a ``...For{Sequence,Token}Classification`` from the head's logits [b, s, labels]: the pooling
    and the loss the model's own forward computes (its own ``loss_function``, which sets ``config.problem_type``)."""
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast, TokenClassifierOutput

    if head == "sequence_classification":
        pooled = pooled_logits(logits, input_ids, model.config)
        loss = None if labels is None else model.loss_function(logits=logits, labels=labels, pooled_logits=pooled,
                                                               config=model.config)
        return SequenceClassifierOutputWithPast(loss=loss, logits=pooled, hidden_states=hidden_states)
    loss = None if labels is None else model.loss_function(logits, labels, model.config)
    return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=hidden_states)
