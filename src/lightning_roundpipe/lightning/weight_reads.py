"""Reads of the module's weights through its usual methods wait for in-flight layer optimizer steps.

Why an instance-level wrapper: the overlapped optimizer updates layers on a host thread while
the next step's forward already runs (that overlap is the point). Lightning's own reads have
strategy hooks (validation start, checkpoint saving, optimizer state) and the strategy joins
there. User code has none: a ``training_step`` computing ``sum(p.square().sum() for p in
self.parameters())`` would read half-updated weights. Joining in ``Strategy.training_step`` would
make every step wait for the whole previous update before its forward, losing the overlap, and
PyTorch has no hook on parameter access. So ``parameters``, ``named_parameters`` and
``state_dict`` of the LightningModule instance join first; :func:`restore` removes the wrappers.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

READS = ("parameters", "named_parameters", "state_dict")


def join_before_reads(module: nn.Module, join: Callable[[], None]) -> None:
    for name in READS:
        original = getattr(type(module), name)

        def joined(*args, _original=original, **kwargs):
            join()
            return _original(module, *args, **kwargs)

        object.__setattr__(module, name, joined)


def restore(module: nn.Module) -> None:
    for name in READS:
        vars(module).pop(name, None)
