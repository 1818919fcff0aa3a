"""Which weights a checkpoint holds, and how strictly it loads.

``checkpoint_weights="full"`` (the default) saves the whole ``state_dict``, exactly what
Lightning's default strategy saves, so a checkpoint of a LoRA run resumes under any strategy
with no extra code. ``"trainable"`` keeps only trainable parameters and buffers: the small
adapter checkpoint, for runs whose frozen base is rebuilt from its model path.

Loading is as strict as the default strategy's ``load_state_dict(strict=strict)``: an unexpected
key, a missing trainable weight or a shape mismatch fails with PyTorch's own message. The one
exception is the documented case of a trainable-only checkpoint: frozen parameters may be absent
(they keep the values the module was built with) when nothing else is missing or unexpected.
"""

from __future__ import annotations

from torch import nn

CHECKPOINT_WEIGHTS = ("full", "trainable")


def checkpoint_state(module: nn.Module, weights: str) -> dict:
    """The module's ``state_dict`` for a checkpoint: all of it, or without frozen parameters."""
    state = module.state_dict()
    if weights == "full":
        return state
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def load_checkpoint_state(module: nn.Module, state: dict, strict: bool) -> None:
    """Load ``state`` as strictly as ``module.load_state_dict(state, strict)``, frozen weights excepted."""
    expected = set(module.state_dict())
    missing = expected - set(state)
    unexpected = set(state) - expected
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    only_frozen_missing = strict and missing and missing <= frozen and not unexpected
    module.load_state_dict(state, strict=strict and not only_frozen_missing)
