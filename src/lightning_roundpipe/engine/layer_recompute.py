"""Layer-grain recompute: a backward stage back-propagated one layer at a time.

Stage-grain recompute keeps every layer's graph of a backward stage alive at once, which at long
sequences a worker cannot hold. Here the stage runs its layers without grad from the stage input,
keeping each layer's input, then recomputes and back-propagates one layer at a time, last to
first: one layer's graph plus the layer inputs are alive, for one more forward. Each layer runs
under the engine's per-layer seed, so the draws match the forward's; a layer writing a shared
carry input in place is refused. Details: docs/design.md, design notes, ``engine/layer_recompute.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch.utils import _pytree as pytree

from ..errors import PipelineError
from .layer_call import differentiable_inputs, differentiable_positions


@dataclass
class LayerCalls:
    """How to run one layer of the stage, as the engine runs it.

    run(layer, carry, forward): the layer's output; ``forward`` True when this call is the
        layer's forward (its buffer writes go home), False when it is a recompute.
    grad_keys(layer): the carry keys that carry a gradient into the layer (None: all floats).
    context(grad): the compute context (grad mode, the caller's autocast).
    vjp(layer, carry, positions, output_grads): with ``recompute_early_stop``, the layer recomputed and
        back-propagated as one compiled graph (``engine/early_stop.py``), its weight gradients added
        into ``.grad``; returns the gradients of the carry's leaves at ``positions`` (None elsewhere).
        None: recompute with grad and back-propagate.
    """

    run: Callable[[int, Any, bool], Any]
    grad_keys: Callable[[int], Any]
    context: Callable[[bool], ContextManager]
    vjp: Callable[[int, Any, tuple, list], list] | None = None


def _shared_versions(tree: Any, wanted: set[int]) -> list[tuple[torch.Tensor, int]]:
    """The tensors of ``tree`` that get no gradient (positions not in ``wanted``), with their version counters."""
    return [(x, x._version) for p, x in enumerate(pytree.tree_leaves(tree)) if isinstance(x, torch.Tensor) and p not in wanted]


def _check_unwritten(layer: int, shared: list[tuple[torch.Tensor, int]]) -> None:
    if any(x._version != v for x, v in shared):
        raise PipelineError(
            f"layer {layer} writes a non-differentiable input of its carry (a mask, rotary table or index) in place; "
            "recompute='layer' shares those inputs between the layers it recomputes, so it cannot run this layer "
            "exactly: use recompute='always'")


def _backward(out: Any, grads: list) -> None:
    """Back-propagate ``grads`` (aligned with ``out``'s leaves) into the layer that made ``out``."""
    pairs = [(o, g) for o, g in zip(pytree.tree_leaves(out), grads)
             if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])


def layer_inputs(calls: LayerCalls, start: int, end: int, tree: Any, forward: bool) -> list[Any]:
    """The inputs of layers ``start .. end - 1`` (the first is ``tree``), computed without grad.

    The last layer is not run: its output is only needed with grad. ``forward``: these calls
    are the layers' forward (the fused last stage), so their buffer writes go home.
    """
    inputs = [tree]
    with calls.context(False):
        for layer in range(start, end - 1):
            carry = inputs[-1]
            wanted = set(differentiable_positions(carry, True, calls.grad_keys(layer)))
            leaves, spec = pytree.tree_flatten(carry)
            fed = pytree.tree_unflatten([x.clone() if p in wanted else x for p, x in enumerate(leaves)], spec)
            shared = _shared_versions(carry, wanted)
            out = calls.run(layer, fed, forward)
            _check_unwritten(layer, shared)
            inputs.append(out)
    return inputs


def backward_by_layer(calls: LayerCalls, start: int, end: int, inputs: list[Any], need_input_grad: bool,
                      output_grads: list | None, loss_scale: float | None = None) -> tuple[list, torch.Tensor | None]:
    """Recompute and back-propagate layers ``end - 1 .. start`` one at a time; ``inputs`` is emptied.

    ``output_grads``: the gradient leaves of the stage output (a backward stage), or None with
    ``loss_scale`` (the fused last stage: the last layer returns ``{"loss_sum": ...}`` and
    ``loss_sum * loss_scale`` is back-propagated). Returns the stage input's flattened leaves'
    gradients (None where none) and the fused stage's detached fp32 ``loss_sum``.
    """
    grads, loss = output_grads, None
    for layer in reversed(range(start, end)):
        tree = inputs[layer - start]
        inputs[layer - start] = None  # this layer's input is not needed after its recompute
        keys = calls.grad_keys(layer)
        shared = _shared_versions(tree, set(differentiable_positions(tree, True, keys)))
        last = loss_scale is not None and layer == end - 1
        if calls.vjp is not None and not last:
            grads = calls.vjp(layer, tree, differentiable_positions(tree, need_input_grad or layer > start, keys), grads)
            _check_unwritten(layer, shared)
            del tree
            continue
        in_leaves, fed = differentiable_inputs(tree, need_input_grad or layer > start, keys)
        # As at stage grain: the fused stage back-propagates inside the compute context (the
        # caller's autocast), a backward stage after it.
        with calls.context(True):
            out = calls.run(layer, fed, last)
            if last:
                loss_sum = out["loss_sum"]
                (loss_sum.float() * loss_scale).backward()
                loss = loss_sum.detach().float()
            elif loss_scale is not None:
                _backward(out, grads)
        if loss_scale is None:
            _backward(out, grads)
        _check_unwritten(layer, shared)
        del out, fed, tree
        grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in in_leaves]
        del in_leaves
    return grads, loss
