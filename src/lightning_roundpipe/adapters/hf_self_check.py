"""The self-check of a Hugging Face family that is not verified (``allow_unverified=True``).

Before any weight changes, the family's pipeline layers must build (``build_layers``) and, on the
first call, compute on the host what the model's own ``forward`` returns for the first microbatch
(``check_first_microbatch``: logits, loss and, for MoE, the aux loss). Any exception or a
difference above ``PARITY_TOLERANCE`` becomes an ``UnsupportedModelError`` naming the family, the
failing part and what to do; the user's model is not changed. Details: docs/design.md, design
notes, ``adapters/hf_self_check.py``.
"""

from __future__ import annotations

import os
import traceback
from typing import Callable

import torch
from torch import nn

from .hf_causal_lm import CausalLMLayers, UnsupportedModelError, count_loss_tokens
from .hf_moe import aux_loss

PARITY_TOLERANCE = 1e-5
"""Largest relative difference ||pipelined - model|| / ||model|| of the first microbatch's logits,
loss and aux loss (fp32, eval mode) accepted for an unverified family."""

WHAT_TO_DO = ("Train it with another strategy (Lightning's default one), or use a verified family (docs/models.md); "
              "a family is verified by an entry in lightning_roundpipe/adapters/hf_families.py with a parity test. "
              "No weight was changed.")


def refusal(model: nn.Module, model_type: str | None, part: str, detail: str) -> UnsupportedModelError:
    """The error an unverified family's failed self-check raises: family, failing part, what to do."""
    return UnsupportedModelError(
        f"{type(model).__name__} (model_type={model_type!r}) is not a verified family, and the self-check of "
        f"allow_unverified=True failed in {part}: {detail}. The causal-LM adapter does not reproduce what its "
        f"forward does. {WHAT_TO_DO}")


def _raised_in(error: BaseException) -> str:
    """The innermost function of this package the error went through (the adapter's part that failed)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename).startswith(package)]
    if not ours:
        return "the adapter"
    frame = ours[-1]
    return f"{frame.name} ({os.path.basename(frame.filename)})"


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")


def build_layers(model: nn.Module, build: Callable[[], CausalLMLayers], allow_unverified: bool) -> CausalLMLayers:
    """``build()``, with any failure of an unverified family's set-up turned into a refusal that names it."""
    if not allow_unverified:
        return build()
    try:
        return build()
    except UnsupportedModelError:
        raise  # already says what is unsupported
    except Exception as error:
        from .hf_families import family_of
        from .hf_causal_lm import unwrap_peft

        inner = unwrap_peft(model)
        model_type = getattr(getattr(inner, "config", None), "model_type", None)
        if family_of(model_type) is not None:
            raise  # a verified family: a bug of ours, not a property of the family
        raise refusal(inner, model_type, f"building its pipeline layers, in {_raised_in(error)}",
                      _described(error)) from error


def _layer_name(index: int, layer: nn.Module, count: int) -> str:
    if index == 0:
        return f"pipeline layer 0 ({type(layer).__name__}: embedding, rotary, masks)"
    if index == count - 1:
        return f"pipeline layer {index} ({type(layer).__name__}: final norm, LM head, loss)"
    inner = getattr(layer, "decoder_layer", layer)
    return f"pipeline layer {index} (decoder layer {index - 1}, {type(inner).__name__})"


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _labels_for(first: dict, labels: torch.Tensor | None) -> torch.Tensor:
    """The user's labels of the microbatch, or its inputs as labels (padding ignored) when it has none to count."""
    if labels is not None and count_loss_tokens(labels) > 0:
        return labels
    made = first["input_ids"].clone()
    if first.get("attention_mask") is not None:
        made[first["attention_mask"] == 0] = -100
    return made


def check_first_microbatch(model: nn.Module, adapter: CausalLMLayers, first: dict,
                           labels: torch.Tensor | None = None) -> dict[str, float]:
    """Compare the pipeline's layers with the model's own forward on one microbatch ``first``.

    ``first``: the microbatch's ``input_ids`` and optional ``attention_mask`` / ``position_ids``;
    ``labels``: its labels, if the call has them. Returns the relative differences by output;
    raises ``UnsupportedModelError`` (see the module doc) when a part fails or differs.
    """
    router = adapter.router
    labels = _labels_for(first, labels)
    modes = {m: m.training for m in model.modules()}
    part = "the model's own forward"
    try:
        model.eval()
        with torch.no_grad():
            try:
                extra = {"output_router_logits": True} if router is not None else {}
                reference = type(model).forward(model, use_cache=False, labels=labels, **first, **extra)
                carry = {**first, "labels": labels, "outputs": "loss_and_logits"}
                if router is not None:
                    carry["router_stats"] = True
                for index, layer in enumerate(adapter.layers):
                    part = _layer_name(index, layer, len(adapter.layers))
                    carry = layer(carry)
            except UnsupportedModelError:
                raise
            except Exception as error:
                raise refusal(model, adapter.model_type, part, _described(error)) from error
    finally:
        for m, training in modes.items():
            m.training = training
    loss = carry["loss_sum"].sum() / count_loss_tokens(labels)
    found = {"logits": _relative(carry["logits"], reference.logits)}
    reference_aux = getattr(reference, "aux_loss", None)
    if router is not None and isinstance(reference_aux, torch.Tensor):
        aux = aux_loss(carry["moe_counts"].sum(0), carry["moe_probs"].sum(0), carry["moe_rows"].sum(), router.num_experts)
        found["aux loss"] = _relative(aux, reference_aux)
        if router.coefficient is not None:
            loss = loss + router.coefficient * aux
    found["loss (with the aux term the family adds)" if router is not None else "loss"] = _relative(loss, reference.loss)
    for name, difference in found.items():
        if not difference <= PARITY_TOLERANCE:
            coefficient = "" if router is None else (
                f"; the adapter adds {router.coefficient!r} x aux loss" if router.coefficient is not None
                else "; the adapter adds no aux term")
            raise refusal(model, adapter.model_type, f"the parity check of the first microbatch",
                          f"the pipelined {name} differs from the model's own forward by {difference:.3g} (relative; at "
                          f"most {PARITY_TOLERANCE:g} is accepted{coefficient})")
    return found


def check_unverified(microbatches: int, model: nn.Module, adapter: CausalLMLayers, batch: dict,
                     labels: torch.Tensor | None) -> dict[str, float]:
    """``check_first_microbatch`` on the first of ``microbatches`` microbatches of a call's ``batch``."""
    from ..engine.microbatch import split_microbatches

    whole = {**batch, **({"labels": labels} if labels is not None else {})}
    first = split_microbatches(whole, min(microbatches, int(batch["input_ids"].shape[0])))[0]
    return check_first_microbatch(model, adapter, {k: v for k, v in first.items() if k != "labels"}, first.get("labels"))
