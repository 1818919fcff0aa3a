"""What HF's mask builders would read from the device, decided on the host instead.

Hugging Face's ``create_causal_mask`` (and its sliding and chunked siblings) take a Python
decision on tensor values: with an ``attention_mask``, sdpa's "can the mask be skipped" test
reads whether every token is kept (``fast_all`` in a condition); without one and without a
cache, the packed-sequence test reads whether ``position_ids`` restart. On a GPU each read is a
device sync, once per mask kind per microbatch, in the worker thread that runs layer 0.

The answers are known on the host before the batch is uploaded. ``host_facts`` computes them
once per batch, per row, as ``HostRows`` (split with the batch, never uploaded), and
``builder_arguments`` turns a microbatch's rows into builder arguments that give the same mask
without the read:

- a mask that keeps every token (as wide as the sequence): no mask and no positions. HF with an
  all-ones mask never looks for packed sequences, and an all-ones padding mask adds nothing to
  any pattern, so the result is the same (None for sdpa where it would skip, the same pattern
  where it would not);
- a mask that pads some token: the mask, no positions (a given mask turns the packed test off),
  and ``allow_is_causal_skip=False``, since the skip test would answer no (a padded token is
  inside the query length);
- no mask: positions only where they are packed (HF's own ``find_packed_sequence_indices`` run on
  the host rows); plain ones (or positions the prefix made, an arange) are dropped, which is the
  packed test's own answer. Packed rows keep HF's path (one read), as do masks given on the
  device or of another shape, and flash-attention's padded masks (its builder reads the mask).
"""

from __future__ import annotations

import torch

from ..engine.microbatch import HostRows

ROWS_UNPADDED = "rows_unpadded"
"""Carry key: ``HostRows`` of bools, whether each row's attention mask keeps every token."""
ROWS_UNPACKED = "rows_unpacked"
"""Carry key: ``HostRows`` of bools, whether each row's ``position_ids`` run without a restart."""
FACT_KEYS = (ROWS_UNPADDED, ROWS_UNPACKED)


def host_facts(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> dict:
    """The per-row facts of a batch's host tensors (none for tensors on a device: reading them would sync)."""
    facts = {}
    if attention_mask is not None and attention_mask.device.type == "cpu" and attention_mask.dim() == 2:
        facts[ROWS_UNPADDED] = HostRows(attention_mask.bool().all(dim=1).tolist())
    if attention_mask is None and position_ids is not None and position_ids.device.type == "cpu" \
            and position_ids.dim() == 2:
        from transformers.masking_utils import find_packed_sequence_indices

        rows = [find_packed_sequence_indices(position_ids[i:i + 1]) is None for i in range(position_ids.shape[0])]
        facts[ROWS_UNPACKED] = HostRows(rows)
    return facts


def builder_arguments(carry: dict, attention_mask, position_ids, q_length: int, positions_made: bool, with_cache: bool):
    """``(attention_mask, position_ids, allow_is_causal_skip)`` for HF's builders, the same mask as
    ``(attention_mask, position_ids, True)`` gives, without a device read where the host knows the answer.

    ``positions_made``: the prefix made ``position_ids`` (an arange, never packed); ``with_cache``:
    the builders get a cache (they then never test for packing)."""
    unpadded, unpacked = carry.get(ROWS_UNPADDED), carry.get(ROWS_UNPACKED)
    if attention_mask is not None:
        if unpadded is None or attention_mask.dim() != 2 or attention_mask.shape[-1] != q_length:
            return attention_mask, position_ids, True
        if all(unpadded.rows):
            return None, None, True
        return attention_mask, None, False
    if with_cache or positions_made or (unpacked is not None and all(unpacked.rows)):
        return None, None, True
    return None, position_ids, True
