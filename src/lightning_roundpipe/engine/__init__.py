"""The engine: runs a plan over a worker pool (forward, backward, fused last stage). No Lightning here."""

from .engine import EngineOptions, PipelineEngine
from .microbatch import MicrobatchError, merge_microbatches, split_microbatches
from .rng import layer_seed, uses_randomness

__all__ = [
    "EngineOptions",
    "MicrobatchError",
    "PipelineEngine",
    "layer_seed",
    "merge_microbatches",
    "split_microbatches",
    "uses_randomness",
]
