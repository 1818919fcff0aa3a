"""The inputs a stage differentiates through: leaves for autograd, copies for the layers.

A backward stage (and a fused or graph-keeping forward stage) makes each floating input a fresh
leaf that requires grad, so that its ``.grad`` is the gradient to pass on. A layer that writes
its input in place (``nn.ReLU(inplace=True)``, ``x.add_(...)``) may not write such a leaf, and
must not write the host copy that recompute reads either. So the layers get a copy of each
leaf (one activation copy per stage input; autograd routes its gradient to the leaf). In
forward without grad the stage input is already the worker's own copy of the host tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def _is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def differentiable_inputs(tree: Any, need: bool, keys=None) -> tuple[list, Any]:
    """``(leaves, tree)``: the flattened leaves (floating ones fresh leaves requiring grad when
    ``need``) and the tree to feed the layers (copies of those leaves, safe to write).

    ``keys``: for a dict carry, only the values under these keys get a gradient (the stage's first
    layer's ``differentiable_carry_keys``); rotary tables and masks are then neither
    differentiated nor shipped back.
    """
    if not need:
        leaves, spec = pytree.tree_flatten(tree)
        return leaves, pytree.tree_unflatten(leaves, spec)
    return inputs_at(tree, differentiable_positions(tree, need, keys))


def inputs_at(tree: Any, positions) -> tuple[list, Any]:
    """``differentiable_inputs`` with the positions among the flattened leaves given: those leaves fresh leaves
    requiring grad, and the tree to feed the layers with copies of them."""
    wanted = set(positions)
    leaves, spec = pytree.tree_flatten(tree)
    leaves = [x.detach().requires_grad_(True) if p in wanted else x for p, x in enumerate(leaves)]
    with torch.enable_grad():
        fed = [x.clone() if p in wanted else x for p, x in enumerate(leaves)]
    return leaves, pytree.tree_unflatten(fed, spec)


def differentiable_positions(tree: Any, need: bool, keys=None) -> tuple[int, ...]:
    """The positions among ``tree``'s flattened leaves that get a gradient (``differentiable_inputs``'s rule):
    none unless ``need``; else the floating tensors, under ``keys`` only for a dict carry when given."""
    leaves = pytree.tree_leaves(tree)
    if not need:
        return ()
    if keys is not None and isinstance(tree, dict):
        wanted = pytree.tree_leaves({k: pytree.tree_map(lambda _, k=k: k in keys, v) for k, v in tree.items()})
    else:
        wanted = [True] * len(leaves)
    return tuple(p for p, (x, w) in enumerate(zip(leaves, wanted)) if w and _is_float_tensor(x))


def kept_copy(tree: Any) -> Any:
    """A stage boundary kept for a backward stage's recompute while the forward goes on: a copy,
    since the next layer may write its input in place."""
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)
