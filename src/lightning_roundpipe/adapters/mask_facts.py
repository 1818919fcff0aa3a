"""What HF's mask builders would read from the device, decided on the host instead.

Hugging Face's ``create_causal_mask`` and its siblings read tensor values to decide (is every
token kept, do ``position_ids`` restart): on a GPU, a device sync per mask kind and microbatch in
the worker running layer 0. ``host_facts`` computes those answers once per batch on the host, per
row (``HostRows``), and ``builder_arguments`` gives each microbatch builder arguments that yield
the same mask, bit for bit, without the read. The cases: docs/design.md, design notes,
``adapters/mask_facts.py``.
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
