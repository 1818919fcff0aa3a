"""Host-side optimizer stepping, overlapped with the pipeline."""

from .overlap import OverlappedOptimizer

__all__ = ["OverlappedOptimizer"]
