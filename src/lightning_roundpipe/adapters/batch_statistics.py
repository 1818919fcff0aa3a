"""Layers whose training forward depends on the whole batch: BatchNorm, and running statistics.

Split into microbatches, a BatchNorm in training mode normalises each with its own statistics
and updates its running statistics once per microbatch, which no single-device run computes. So
the call is refused by default (``batch_statistics="refuse"``) before any weight changes;
``"per_microbatch"`` accepts GPipe's semantics. With ``microbatches=1``, or such layers in eval
mode, the run is exact. Details: docs/design.md, design notes, ``adapters/batch_statistics.py``.
"""

from __future__ import annotations

from torch import nn

from ..engine.microbatch import MicrobatchError, batch_size_of
from ..options import OptionError

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
               nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)
INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
                  nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d)


def depends_on_batch(module: nn.Module) -> bool:
    """Whether ``module``, in its current mode, computes something a split batch changes."""
    if isinstance(module, BATCH_NORMS):  # batch statistics in training, and without running statistics at all
        return module.training or module.running_mean is None
    if isinstance(module, INSTANCE_NORMS):  # per sample, but the running statistics move per call
        return module.training and module.track_running_stats
    return False


class BatchStatistics:
    """The batch-dependent modules among the pipelined layers, checked at every pipelined call."""

    def __init__(self, layers: list[nn.Module], setting: str, owner: str):
        self.setting = setting
        self.owner = owner
        self.found = [(i, name, m) for i, layer in enumerate(layers) for name, m in layer.named_modules()
                      if isinstance(m, BATCH_NORMS + INSTANCE_NORMS)]

    def layers_accepted(self) -> set[int]:
        """Layers whose per-microbatch statistics the user accepted (no warning needed)."""
        return {i for i, _, _ in self.found} if self.setting == "per_microbatch" else set()

    def check_call(self, inputs, microbatches: int) -> None:
        """Refuse, before anything runs, a call of ``inputs`` whose BatchNorm would see per-microbatch statistics."""
        try:
            size = batch_size_of(inputs)
        except MicrobatchError:
            return  # the engine's split says what is wrong with the batch
        self.check(min(size, microbatches))

    def check(self, microbatches: int) -> None:
        """Refuse a call of ``microbatches`` microbatches that a batch-dependent layer would compute inexactly."""
        if microbatches <= 1 or self.setting == "per_microbatch":
            return
        for i, name, m in self.found:
            if depends_on_batch(m):
                where = f"layer {i}" + (f" (its `{name}`)" if name else "")
                raise OptionError(
                    f"{self.owner}(batch_statistics='refuse'): pipelined {where} is a {type(m).__name__} in training "
                    f"mode: with microbatches={microbatches} each microbatch would be normalised with its own "
                    "statistics and the running statistics updated once per microbatch, which differs from a "
                    "single-device run. Use microbatches=1 for the exact result, put the layer in eval mode, or pass "
                    "batch_statistics='per_microbatch' to accept per-microbatch statistics (GPipe's). Nothing ran: "
                    "the weights are as they were.")
