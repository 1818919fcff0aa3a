"""Which pipelined calls still owe the weights a gradient, and what the running backward asks for.

A step may call the pipelined module more than once and run backward more than once
(``torch.autograd.grad`` before ``loss.backward()``); the overlapped optimizer may step a layer
early only once every contribution to its gradient has arrived, and this module tells it: which
training calls are pending, whether a backward adds weight gradients (it runs the engine's anchor
leaf's accumulator) and which pipelined parameters it also reaches outside the pipeline. The
rules: docs/design.md, design notes, ``engine/calls.py``.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ..errors import PipelineError


def grad_accumulator(leaf: torch.Tensor):
    """The AccumulateGrad node of a leaf that requires grad (created if no graph holds one yet)."""
    with torch.enable_grad():
        return leaf.view_as(leaf).grad_fn.next_functions[0][0]


class PipelineCalls:
    """The training calls of an engine whose weight backward has not run yet."""

    def __init__(self, anchor: torch.Tensor, parameters):
        self._anchor_node = grad_accumulator(anchor)  # kept: autograd holds its nodes only weakly
        self._parameters = parameters  # callable: the pipelined host parameters
        self._pending: weakref.WeakSet = weakref.WeakSet()
        self.current = None  # the call whose weight backward is running
        self.reached_outside: set[int] = set()  # ids of parameters this backward reaches outside the pipeline

    def started(self, run) -> None:
        """Record a pipelined call whose backward is still to come."""
        self._pending.add(run)

    def finished(self, run) -> None:
        """``run`` added its weight gradients (an owed backward tail finished, or failed)."""
        self._pending.discard(run)

    def others_pending(self) -> bool:
        """True while a call other than the one in backward has not added its weight gradients."""
        return any(r is not self.current for r in list(self._pending))

    @contextlib.contextmanager
    def backward(self, run):
        """Around one backward of ``run``: yields whether this backward adds weight gradients."""
        if torch.is_grad_enabled():
            raise PipelineError(
                "backward through the pipelined module with create_graph=True (double backward, e.g. a gradient "
                "penalty differentiated again) is not supported: the pipeline's backward is not differentiable. "
                "Compute the penalty outside the pipelined module, or train with the default strategy")
        wants_weights = bool(torch._C._will_engine_execute_node(self._anchor_node))
        if not wants_weights:
            yield False
            return
        self.reached_outside = {id(p) for p in self._parameters() if p.requires_grad
                                and torch._C._will_engine_execute_node(grad_accumulator(p))}
        self.current = run
        try:
            yield True
        finally:
            self._pending.discard(run)
            self.current = None
            self.reached_outside = set()
