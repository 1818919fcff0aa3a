"""Telling the user, once, that a training call ran unpipelined.

Some calls of a pipelined causal LM run the model's own forward on the host instead of the
pipeline, because the pipeline cannot split them into stages: a call with a key/value cache
(``model.generate()``, or peft's prefix tuning, which passes its virtual tokens as
``past_key_values`` on every call) or with ``use_cache=True``. That is exact, and meant for a few
samples in ``validation_step``; in training it silently moves the whole step onto the host CPU.
So the first such call that trains (grad enabled, module in training mode) warns with an
``UnpipelinedCallWarning`` saying why and what to do, once per reason and runtime;
``generate()`` (no grad) never warns.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


class UnpipelinedCallWarning(UserWarning):
    """A training call ran the model's own forward on the host, not the pipeline (see the module doc)."""


CACHE_GIVEN = "cache"
USE_CACHE = "use_cache"

_WHY = {
    CACHE_GIVEN: ("it passes a key/value cache (past_key_values / cache), as peft's prefix tuning does with its virtual "
                  "tokens on every call, and the pipeline cannot split a cache into stages. Use another peft method "
                  "such as LoRA, or Lightning's default strategy"),
    USE_CACHE: ("it asks for use_cache=True, and the pipeline builds no key/value cache. Pass use_cache=False in "
                "training_step (or set model.config.use_cache=False) to pipeline it"),
}


class UnpipelinedNotice:
    """Warns on the first training call that runs unpipelined, once per reason (one per runtime)."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def training_call(self, model: nn.Module, reason: str) -> None:
        """Warn if this call trains (grad enabled, ``model`` in training mode) and ``reason`` was not yet said."""
        if reason in self.said or not (torch.is_grad_enabled() and model.training):
            return
        self.said.add(reason)
        warnings.warn(
            f"RoundPipe: a training call of {type(model).__name__} runs unpipelined, with the model's own forward on "
            f"the host CPU (exact, but nothing of it runs on the workers): {_WHY[reason]}. Said once per fit.",
            UnpipelinedCallWarning, stacklevel=4)
