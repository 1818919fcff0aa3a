"""Precision: what Lightning's precision plugins mean for a pipeline whose state lives on the host.

- ``32-true``: fp32 everywhere; nothing to translate.
- ``bf16-mixed`` (Lightning's ``MixedPrecision``): fp32 masters on the host, bf16 weights
  uploaded (from bf16 shadows refreshed by each layer's optimizer step), autocast re-entered on
  the workers and in recompute. Gradients come back in bf16 and are accumulated in fp32.
- ``16-mixed``: as bf16-mixed with fp16, plus loss scaling. The scaler must unscale and check
  the gradients where they live, on the host, so a CUDA ``GradScaler`` is replaced by a host
  one (``HostScaledMixedPrecision``); on overflow the step is skipped and no layer gets a
  new version. Lightning turns ``precision="16-mixed"`` into bf16 on ``accelerator="cpu"``; to
  get fp16 with loss scaling on the CPU backend, pass ``plugins=[HostScaledMixedPrecision()]``.
- ``bf16-true`` / ``16-true`` (Lightning's ``HalfPrecision``): the module itself is converted, so
  masters, gradients and optimizer state are in that dtype on the host (no fp32 masters).
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision


class HostScaledMixedPrecision(MixedPrecision):
    """fp16 autocast on the workers, loss scaling with unscale and inf/NaN checks on host gradients."""

    def __init__(self, device: str = "cpu", init_scale: float = 2.0**16):
        super().__init__("16-mixed", device, scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


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
