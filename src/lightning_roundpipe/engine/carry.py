"""A carry on the host (a microbatch's activations or gradients between stages), as flat leaves and a spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclass
class HostCarry:
    """A carry on the host: its flattened leaves (tensors or plain values) and tree spec."""

    leaves: list
    spec: Any

    @staticmethod
    def of(tree: Any) -> "HostCarry":
        """A carry of ``tree``'s leaves and structure."""
        leaves, spec = pytree.tree_flatten(tree)
        return HostCarry(leaves, spec)

    def tree(self) -> Any:
        """The carry as the original tree."""
        return pytree.tree_unflatten(self.leaves, self.spec)

    def nbytes(self) -> int:
        """Bytes of the carry's tensors."""
        return sum(x.numel() * x.element_size() for x in self.leaves if isinstance(x, torch.Tensor))
