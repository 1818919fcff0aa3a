"""Reads of the module's weights through its usual methods wait for in-flight layer optimizer steps.

With ``staleness=0`` the strategy's ``optimizer_step`` already joins before it returns (no read
after a step can see weights being written: PyTorch has no hook on tensor access, so an EMA
over the inner model's tensors could not be caught any other way; measured cost in
``docs/measurements.md``, section 5). These wrappers cover what that join does not: reads
while layers step during backward (a tensor hook calling ``self.parameters()``) and
``staleness=1``, whose update runs behind the next step by design. ``parameters``,
``named_parameters`` and ``state_dict`` of the LightningModule instance join first;
``restore`` removes the wrappers.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

READS = ("parameters", "named_parameters", "state_dict")


def join_before_reads(module: nn.Module, join: Callable[[], None]) -> None:
    """Make the module's weight reads (``parameters()``, ``state_dict()``, ...) call ``join`` first."""
    for name in READS:
        original = getattr(type(module), name)

        def joined(*args, _original=original, **kwargs):
            join()
            return _original(module, *args, **kwargs)

        object.__setattr__(module, name, joined)


def restore(module: nn.Module) -> None:
    """Undo ``join_before_reads``."""
    for name in READS:
        vars(module).pop(name, None)
