"""Reads of the module's weights through its usual methods wait for in-flight layer optimizer steps.

With ``staleness=0`` the strategy's ``optimizer_step`` already joins before it returns (no read
after a step can see weights being written: PyTorch has no hook on tensor access, so an EMA
over the inner model's tensors could not be caught any other way; measured cost in
``docs/measurements.md``, section 5). These wrappers cover what that join does not: reads
while layers step during backward (a tensor hook calling ``self.parameters()``) and
``staleness=1``, whose update runs behind the next step by design. ``parameters``,
``named_parameters`` and ``state_dict`` of the LightningModule instance join first;
``restore`` removes the wrappers. A deep copy of the module (an EMA callback's
``copy.deepcopy(pl_module)``) gets the class's own methods bound to the copy, so it reads its own weights.
"""

from __future__ import annotations

import copy
import types
from typing import Callable

from torch import nn

from ..user_patches import remove_instance_attribute, set_instance_attribute

READS = ("parameters", "named_parameters", "state_dict")


class JoinedRead:
    """``module.<name>(...)`` that calls ``join`` first."""

    def __init__(self, module: nn.Module, name: str, join: Callable[[], None]) -> None:
        self.module, self.name, self.join = module, name, join

    def __call__(self, *args, **kwargs):
        self.join()
        return getattr(type(self.module), self.name)(self.module, *args, **kwargs)

    def __deepcopy__(self, memo: dict):
        # the copy under construction is in memo already (copy's _reconstruct puts it there first)
        return types.MethodType(getattr(type(self.module), self.name), copy.deepcopy(self.module, memo))


def join_before_reads(module: nn.Module, join: Callable[[], None]) -> None:
    """Make the module's weight reads (``parameters()``, ``state_dict()``, ...) call ``join`` first."""
    for name in READS:
        set_instance_attribute(module, name, JoinedRead(module, name, join))


def restore(module: nn.Module) -> None:
    """Undo ``join_before_reads``."""
    for name in READS:
        remove_instance_attribute(module, name)
