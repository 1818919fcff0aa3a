"""Telling the user, once, that a training call ran unpipelined.

Some calls of a pipelined causal LM run the model's own forward on the host instead of the
pipeline, because the pipeline cannot split them into stages: a call with a key/value cache
(``model.generate()``, or peft's prefix tuning, which passes its virtual tokens as
``past_key_values`` on every call) or with ``use_cache=True``. That is exact, and meant for a few
samples in ``validation_step``; in training it silently moves the whole step onto the host CPU.
So the first such call that trains (grad enabled, module in training mode) warns with an
``UnpipelinedCallWarning`` saying why and what to do, once per reason and runtime;
``generate()`` (no grad) never warns. ``DirectDecoderCalls`` does the same for a training call of the
decoder inside a pipelined causal LM (``self.model.model(...)``), which bypasses the pipeline.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..errors import UnpipelinedCallWarning


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


class DirectDecoderCalls:
    """Warns once when the decoder inside a pipelined causal LM (``LlamaForCausalLM.model``) is called
    directly in training: that call runs the whole decoder unpipelined on the host CPU, silently.
    Calls that come through the pipelined model itself (its own unpipelined paths) say nothing here.
    ``remove`` takes the hooks away (the module is as it was)."""

    def __init__(self, outer: nn.Module, decoder: nn.Module) -> None:
        self.depth = 0
        self.said = False
        self.outer_name, self.decoder_name = type(outer).__name__, type(decoder).__name__
        self.handles = [
            outer.register_forward_pre_hook(self._enter),
            outer.register_forward_hook(self._leave, always_call=True),
            decoder.register_forward_pre_hook(self._decoder_called),
        ]

    def _enter(self, module, args) -> None:
        self.depth += 1

    def _leave(self, module, args, output) -> None:
        self.depth -= 1

    def _decoder_called(self, module, args) -> None:
        if self.said or self.depth or not (torch.is_grad_enabled() and module.training):
            return
        self.said = True
        warnings.warn(
            f"RoundPipe: the {self.decoder_name} inside the pipelined {self.outer_name} was called directly in "
            "training, so it ran whole and unpipelined on the host CPU (exact, but nothing of it runs on the workers: "
            f"slow on a GPU server). Call the {self.outer_name} itself (with labels for its loss, or "
            "output_hidden_states=True for the last hidden state), or name the decoder's layers with "
            "RoundPipeStrategy(module=...). Said once per fit.", UnpipelinedCallWarning, stacklevel=3)

    def remove(self) -> None:
        """Take the hooks away."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
