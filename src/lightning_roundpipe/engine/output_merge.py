"""The caller's output assembled while the pipeline still runs: no copy left after the last microbatch.

Stacking the microbatch outputs after the last one arrived is a copy of the whole output (for a
language model, the logits) while every worker idles; instead each microbatch's output is copied
into its rows of one batch-sized tensor as soon as it is on the host. A leaf that does not fit
that shape is stacked with ``torch.cat`` as before: the merged output is the same, bit for bit.
Details: docs/design.md, design notes, ``engine/output_merge.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from .carry import HostCarry
from .microbatch import merge_microbatches


class OutputAssembly:
    """Rows of the merged output, filled microbatch by microbatch (``add``), read with ``merged``.

    ``sizes``: the batch size of every microbatch, in order.
    """

    def __init__(self, sizes: list[int]):
        self.sizes = list(sizes)
        self.offsets = [sum(self.sizes[:m]) for m in range(len(self.sizes))]
        self.buffers: dict[int, torch.Tensor | None] = {}  # leaf index -> batch-sized tensor (None: stacked)
        self.placed = 0  # microbatches added

    def _fits(self, leaf, m: int, first: torch.Tensor | None) -> bool:
        if not (isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and leaf.dim() > 0
                and leaf.shape[0] == self.sizes[m] and leaf.is_contiguous() and not leaf.requires_grad):
            return False
        return first is None or (leaf.shape[1:] == first.shape[1:] and leaf.dtype == first.dtype
                                 and leaf.device == first.device)

    def add(self, m: int, carry: HostCarry) -> None:
        """Copy microbatch ``m``'s output leaves into their rows (in place: ``carry`` then holds views
        of those rows, so the microbatch's own tensors are freed). Microbatches come in order."""
        if len(self.sizes) < 2:
            return  # one microbatch: its output is the merged one, nothing to copy
        for i, leaf in enumerate(carry.leaves):
            if m == 0:
                if not self._fits(leaf, 0, None):
                    self.buffers[i] = None
                    continue
                self.buffers[i] = torch.empty((sum(self.sizes), *leaf.shape[1:]), dtype=leaf.dtype, device=leaf.device)
            buffer = self.buffers.get(i)
            if buffer is None:
                continue
            if not self._fits(leaf, m, buffer):
                self.buffers[i] = None  # stacked after all: the rows copied so far are views the cat reads
                continue
            rows = buffer.narrow(0, self.offsets[m], self.sizes[m])
            rows.copy_(leaf)
            carry.leaves[i] = rows
        self.placed = m + 1

    def merged(self, trees: list[Any]) -> Any:
        """The merged output of ``trees`` (the microbatch outputs, in order): the filled tensors
        where every microbatch was placed, ``torch.cat`` for the other leaves."""
        done = self.placed == len(self.sizes)
        # An alias of each filled tensor, not the tensor the rows are views of: autograd makes the
        # returned tensor hold the call (its grad_fn), and the call holds the rows; a row whose
        # base were that tensor would close a cycle through C++ that Python's collector cannot
        # break, and every call's memory would stay.
        filled = {i: b.detach() for i, b in self.buffers.items() if b is not None} if done else {}
        return merge_microbatches(trees, filled)
