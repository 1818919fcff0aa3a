"""Precision: what Lightning's precision plugins mean for a pipeline whose state lives on the host.

``32-true`` needs nothing; ``bf16-mixed`` keeps fp32 masters on the host, uploads bf16 shadows
and re-enters autocast on the workers, accumulating gradients in fp32; ``16-mixed`` does the same
in fp16 with loss scaling, which must unscale and check gradients where they live, so a host
``GradScaler`` replaces CUDA's (``HostScaledMixedPrecision``; on the CPU backend pass it as a
plugin); ``bf16-true`` / ``16-true`` convert the module itself (no fp32 masters). How early layer
steps work under the scaler: docs/design.md, design notes, ``lightning/precision.py``.
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from typing_extensions import override


class HostScaledMixedPrecision(MixedPrecision):
    """fp16 autocast on the workers, loss scaling with unscale and inf/NaN checks on host gradients."""

    def __init__(self, device: str = "cpu", init_scale: float = 2.0**16):
        super().__init__("16-mixed", device, scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))
        self.early = {}  # id(optimizer) -> the OverlappedOptimizer that steps its layers early (steps_early)

    def steps_early(self, overlapped) -> None:
        """Drive ``overlapped`` (an ``OverlappedOptimizer`` built with this plugin's scaler) through its
        own loss-scaled step; ``None`` forgets every one (the fit is over)."""
        if overlapped is None:
            self.early = {}
        else:
            self.early[id(overlapped.optimizer)] = overlapped

    @override
    def optimizer_step(self, optimizer, model, closure, **kwargs):
        """``MixedPrecision.optimizer_step`` with the closure run inside the overlapped step, so layers
        step during backward: the same hooks, the same unscaling, the same skip and ``update``."""
        overlapped = self.early.get(id(optimizer))
        if overlapped is None or overlapped.optimizer is not optimizer or kwargs:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        results = []

        def closure_then_hooks():
            result = closure()
            results.append(result)
            if result is None and model.automatic_optimization:
                overlapped.skip_step()  # backward was skipped: MixedPrecision neither steps nor updates
            # The hooks between backward and the step (none overridden, or layers would not step early).
            self._after_closure(model, optimizer)
            return result

        optimizer.step(closure=closure_then_hooks)
        result = results[0] if results else None
        if result is None and model.automatic_optimization:
            return result
        self.scaler.update()
        return None  # what GradScaler.step returns here: optimizer.step() without a closure


def compute_dtype_of(plugin: Precision) -> torch.dtype | None:
    """The dtype weights are uploaded in under this plugin (None: as stored on the host)."""
    if isinstance(plugin, MixedPrecision):
        return torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
    return None


def translate(plugin: Precision, worker_device_type: str) -> Precision:
    """Replace a plugin whose scaler would look for gradients on the GPU by the host-scaled one."""
    if isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed" and not isinstance(plugin, HostScaledMixedPrecision):
        return HostScaledMixedPrecision(device=worker_device_type)
    return plugin
