"""The one wrapper around the user's optimizer: its ``step`` and ``zero_grad`` routed to the pipeline.

``StepRouting.install`` sets both as instance attributes (through ``user_patches``), so Lightning's
loop, a closure-taking precision plugin and the user all reach the overlapped optimizer by calling
``optimizer.step()``; ``close`` joins, stops the host lane and gives the optimizer its own methods
back (or the LR scheduler's step wrapper that was there).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..user_patches import remove_instance_attribute, set_instance_attribute
from .overlap import OverlappedOptimizer

ROUTED = ("step", "zero_grad")


class StepRouting:
    """Routes ``optimizer.step`` / ``zero_grad`` to ``overlapped``, each first finishing an owed
    backward tail (``finish_backward``: the engine's; ``RoundPipeRuntime.returning_early``): ``step``
    after its closure (whose forward finishes it anyway, overlapped) and before any layer is stepped,
    ``zero_grad`` before it clears."""

    def __init__(self, optimizer: torch.optim.Optimizer, overlapped: OverlappedOptimizer,
                 finish_backward: Callable[[], None]) -> None:
        self.optimizer = optimizer
        self.overlapped = overlapped
        self.finish_backward = finish_backward
        self._saved = {k: vars(optimizer)[k] for k in ROUTED if k in vars(optimizer)}  # e.g. an LR scheduler's
        self._installed = False

    def install(self) -> None:
        """Route the optimizer's calls here (instance attributes shadowing its class's methods)."""
        set_instance_attribute(self.optimizer, "step", self.step)
        set_instance_attribute(self.optimizer, "zero_grad", self.zero_grad)
        self._installed = True

    def step(self, closure=None):
        """``optimizer.step``: the overlapped optimizer's step, after the owed backward tail."""
        if closure is None:
            self.finish_backward()
            return self.overlapped.step()

        def closure_then_tail():
            loss = closure()
            self.finish_backward()
            return loss

        return self.overlapped.step(closure_then_tail)

    # An LR scheduler looks for this marker on ``optimizer.step`` (a bound method shows its function's
    # attributes) to know the step still sets ``_opt_called``: the overlapped step sets it itself.
    step._wrapped_by_lr_sched = True

    def zero_grad(self, set_to_none: bool = True):
        """``optimizer.zero_grad``: the overlapped optimizer's, after the owed backward tail."""
        self.finish_backward()
        return self.overlapped.zero_grad(set_to_none)

    def close(self) -> None:
        """Join and stop the overlapped optimizer, then give the optimizer back what it had (idempotent;
        the optimizer's methods come back even when the join raises)."""
        try:
            self.overlapped.close()
        finally:
            if self._installed:
                self._installed = False
                for name in ROUTED:
                    remove_instance_attribute(self.optimizer, name)
                for name, value in self._saved.items():
                    set_instance_attribute(self.optimizer, name, value)
