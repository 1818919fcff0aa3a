"""What a Hugging Face model's forward does with its call options, reproduced for the pipelined forward.

Each call option is read exactly as the model's own forward reads it: ``use_cache``
(``forward_uses_cache``), ``output_hidden_states`` (only the last hidden state leaves the
pipeline: ``hidden_states_request``, ``LastHiddenStateOnly``), ``logits_to_keep``
(``logits_to_keep_for_batch``) and sequence classification's pooling (``pooled_logits``).
Details: docs/design.md, design notes, ``adapters/hf_outputs.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import HiddenStatesNotReturnedError
from .input_errors import UnsupportedInputError


def forward_uses_cache(base_model: nn.Module, use_cache: bool | None) -> bool:
    """Whether the model's forward, called with ``use_cache``, holds a cache (HF's ``merge_with_config_defaults``).

    ``base_model``: the module whose forward builds the masks (``model.base_model``, e.g. ``Qwen3Model``).
    """
    value = use_cache if use_cache is not None else getattr(base_model.config, "use_cache", None)
    checkpointing = getattr(base_model, "gradient_checkpointing", False)
    if value and checkpointing and base_model.training and torch.is_grad_enabled():
        return False  # HF turns the cache off under gradient checkpointing, and so the masks detect packing
    return bool(value)


def _refused(option: str, reason: str) -> ValueError:
    return ValueError(f"the RoundPipe pipeline cannot return {option}: {reason}. Nothing was run and no weight "
                      "changed.")


def hidden_states_request(output_hidden_states: Any, config: Any, num_layers: int) -> str | None:
    """What ``output_hidden_states`` (or the config's default) asks of the pipeline.

    Returns None (no hidden states), ``"all"`` (``True``: every hidden state, of which only the
    last can be read) or ``"last"`` (an index selection of the last one only, as transformers
    accepts: ``-1``, ``[-1]``, ``num_layers``). Raises ``ValueError`` naming the option for a
    selection of any other hidden state.
    """
    if output_hidden_states is None:
        output_hidden_states = getattr(config, "output_hidden_states", False)
    if not output_hidden_states:
        return None
    if isinstance(output_hidden_states, bool):
        return "all"
    selected = [output_hidden_states] if isinstance(output_hidden_states, int) else list(output_hidden_states)
    count = num_layers + 1
    resolved = {i % count for i in selected if -count <= i < count}
    if resolved - {num_layers}:
        raise _refused(f"output_hidden_states={output_hidden_states!r}",
                       "only the last hidden state (the final norm's output) leaves the pipeline's last stage; the "
                       "others stay on the workers. Select the last one (output_hidden_states=-1) or run a hook "
                       "inside the layer that needs them")
    return "last"


def refuse_attentions(output_attentions: Any, config: Any) -> None:
    """``output_attentions`` (or the config's default) is refused: the weights stay on the workers."""
    if output_attentions is None:
        output_attentions = getattr(config, "output_attentions", False)
    if output_attentions:
        raise _refused("output_attentions=True", "the attention weights of every layer stay on the workers (and "
                       "the fused attention kernels never build them). Leave output_attentions off (also in the "
                       "model's config)")


class LastHiddenStateOnly(Sequence):
    """The ``hidden_states`` of an ``output_hidden_states=True`` call: ``num_layers + 1`` entries, of
    which only the last (``[-1]``, the final norm's output) is held; reading any other raises
    ``HiddenStatesNotReturnedError`` with what to do."""

    def __init__(self, last: torch.Tensor, count: int):
        self.last = last
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self.count)))
        position = index + self.count if index < 0 else index
        if position == self.count - 1:
            return self.last
        if not 0 <= position < self.count:
            raise IndexError(f"hidden_states index {index} out of range ({self.count} hidden states)")
        raise HiddenStatesNotReturnedError(
            f"hidden_states[{index}] is not returned by the RoundPipe pipeline: only the last hidden state "
            f"(hidden_states[-1], the final norm's output) leaves its last stage. Pass output_hidden_states=-1 to ask "
            "for exactly that one, or run a forward hook inside the layer whose output you need."
        )

    def __repr__(self) -> str:
        return f"LastHiddenStateOnly(count={self.count}, last={tuple(self.last.shape)})"


def hidden_states_output(request: str | None, last: torch.Tensor | None, num_layers: int):
    """The ``hidden_states`` field of the output for a ``hidden_states_request`` answer."""
    if request is None:
        return None
    if request == "last":  # what transformers returns for a selection: None where not selected
        return (None,) * num_layers + (last,)
    return LastHiddenStateOnly(last, num_layers + 1)


def logits_to_keep_for_batch(logits_to_keep: Any, batch_size: int) -> Any:
    """``logits_to_keep`` in a form that splits into microbatches (None when every position is kept).

    An int stays an int; a 1-D tensor of positions (the same for every row) becomes the equivalent
    [batch, positions] tensor, which transformers' ``slice_logits_to_keep`` gathers the same way and
    which splits by row; a 2-D tensor (positions or a boolean mask per row) already splits by row.
    """
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dim() == 1:
            return logits_to_keep.unsqueeze(0).expand(batch_size, -1)
        if logits_to_keep.dim() == 2 and logits_to_keep.shape[0] == batch_size:
            return logits_to_keep
        raise UnsupportedInputError(f"logits_to_keep must be an int, a 1-D tensor of positions or a [batch, ...] tensor; got "
                         f"shape {tuple(logits_to_keep.shape)} for a batch of {batch_size}")
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise UnsupportedInputError(f"logits_to_keep must be an int or a tensor, got {logits_to_keep!r}")
    return None if logits_to_keep == 0 else logits_to_keep


def slice_positions(hidden: torch.Tensor, logits_to_keep: Any) -> torch.Tensor:
    """The rows of ``hidden`` [b, s, h] the head is applied to, as transformers' ``slice_logits_to_keep``."""
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep.to(hidden.device)]
        return torch.take_along_dim(hidden, logits_to_keep.to(hidden.device)[..., None], dim=1)
    return hidden[:, -logits_to_keep:, :]


def pooled_logits(logits: torch.Tensor, input_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """The logits of each row's last non-padding token (``...ForSequenceClassification``; left or right padding)."""
    pad = config.get_text_config().pad_token_id
    rows = input_ids.shape[0]
    if pad is None and rows != 1:
        raise UnsupportedInputError("Cannot handle batch sizes > 1 if no padding token is defined.")
    if pad is None:
        last = -1
    else:
        # the rightmost position whose token is not the pad token, computed as the model does
        not_pad = (input_ids != pad).to(logits.device, torch.int32)
        positions = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
        last = (positions * not_pad).argmax(-1)
    return logits[torch.arange(rows, device=logits.device), last]
