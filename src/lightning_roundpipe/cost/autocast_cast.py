"""Which parameters a mixed precision uploads in its lower dtype, and what each costs on a worker.

Under ``bf16-mixed`` / ``16-mixed`` autocast runs ``nn.Linear`` and ``nn.Conv*d`` in the lower
precision and keeps everything else (embedding lookups, norms) in fp32. The runtime uploads
only the parameters autocast casts in the lower dtype (``params/shadows.py``); a trainable one becomes
an fp32 leaf on the worker, so its gradient accumulates in fp32 (``params/weights.py``). This module
holds that rule once: the runtime's uploads and the cost model's per-layer bytes both read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

# Modules whose forward autocast runs in its lower precision, weight and bias included (F.linear, conv).
AUTOCAST_CAST_FORWARDS = frozenset(m.forward for m in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))


def autocast_cast_parameters(layers: Sequence[nn.Module]) -> set[int]:
    """Ids of the parameters that autocast casts to its lower precision wherever they are used:
    those held only by modules running ``nn.Linear``'s or ``nn.Conv*d``'s own forward. A
    parameter also held by any other module (a head tied to the embedding) is not among them."""
    cast, kept = set(), set()
    for layer in layers:
        for m in layer.modules():
            lower = type(m).forward in AUTOCAST_CAST_FORWARDS
            for p in m.parameters(recurse=False):
                (cast if lower else kept).add(id(p))
    return cast - kept


def device_dtype(master: torch.Tensor, upload_dtype: torch.dtype, trainable: bool) -> torch.dtype:
    """The dtype a worker holds an uploaded tensor in: a trainable floating parameter as a leaf in
    its master's dtype (its gradient then accumulates in fp32), anything else as uploaded."""
    return master.dtype if trainable and master.is_floating_point() else upload_dtype


def download_dtype(device: torch.dtype, upload: torch.dtype) -> torch.dtype:
    """The dtype a worker downloads a gradient in, for a tensor held in ``device`` and uploaded in
    ``upload``: bf16 for an fp32 leaf uploaded in bf16, else ``device``. The leaf's gradient is the
    stage's microbatches summed in fp32; rounding that sum to bf16 once is what Lightning's
    bf16-mixed does per backward call (the gradient of autocast's bf16 cast is bf16; autograd casts
    it to fp32 and adds it into ``.grad``). fp16 keeps fp32 downloads: a sum rounded to fp16 could
    overflow or flush where the microbatches' own fp16 gradients did not."""
    return torch.bfloat16 if upload == torch.bfloat16 and device == torch.float32 else device


@dataclass(frozen=True)
class LayerDeviceBytes:
    """One layer's weight bytes: ``upload`` over the link, ``held`` on the worker while a stage
    computes with them (the leaves, plus autocast's lower-precision copy of each trainable cast
    parameter, cached for the task), ``grads`` of its trainable parameters on the worker,
    ``downloads`` of those gradients over the link (``download_dtype``)."""

    upload: int
    held: int
    grads: int
    downloads: int


def layer_device_bytes(layers: Sequence[nn.Module], compute_dtype: torch.dtype | None) -> list[LayerDeviceBytes]:
    """``LayerDeviceBytes`` of each of ``layers`` (the whole pipelined module, so that tied
    parameters are judged as the runtime judges them), computing in ``compute_dtype`` (None: the
    parameters' own dtypes). A parameter held by two layers is counted in each."""
    cast = autocast_cast_parameters(layers) if compute_dtype is not None else set()
    out = []
    for layer in layers:
        upload = held = grads = downloads = 0
        for p in {id(t): t for t in layer.parameters()}.values():
            lower = id(p) in cast and p.is_floating_point()
            up = compute_dtype if lower else p.dtype
            trainable = p.requires_grad and p.is_floating_point()
            upload += p.numel() * up.itemsize
            held += p.numel() * device_dtype(p, up, trainable).itemsize
            if trainable:
                grads += p.numel() * p.dtype.itemsize
                downloads += p.numel() * download_dtype(p.dtype, up).itemsize
                if up != p.dtype:  # autocast casts the fp32 leaf back at use and caches the copy
                    held += p.numel() * up.itemsize
        buffers = sum(b.numel() * b.element_size() for b in {id(t): t for t in layer.buffers()}.values())
        out.append(LayerDeviceBytes(upload + buffers, held + buffers, grads, downloads))
    return out
