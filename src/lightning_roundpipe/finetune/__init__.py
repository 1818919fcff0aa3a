"""Reusable fine-tuning pieces: a data module (text and chat files, optionally packed), a causal-LM
LightningModule, a throughput callback and input checks. None of them depends on RoundPipe; the strategy is chosen by the
Trainer (see ``examples/finetune.py`` and ``docs/finetune.md``).
"""

from .checks import FineTuneInputError
from .data import TextDataModule
from .module import CausalLMFineTune, LoraOptions, OptimOptions
from .throughput import TokenThroughput

__all__ = [
    "CausalLMFineTune",
    "FineTuneInputError",
    "LoraOptions",
    "OptimOptions",
    "TextDataModule",
    "TokenThroughput",
]
