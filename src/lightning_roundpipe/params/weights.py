"""Host-resident parameters, per layer: what a stage uploads and where its gradients go.

The module's own parameters (fp32 for full training) are the masters: they never leave the
host. For a stage, the unique host tensors of its layers (a tied tensor used twice is uploaded
once) are copied to the worker in chunks, cast to the compute dtype (floating parameters only;
buffers keep their dtype). Trainable ones become leaf tensors that collect the stage's gradient
over all microbatches; that gradient is downloaded once (a bf16 upload's in bf16,
``download_dtype``) and added to the host ``.grad`` in a fixed order. Frozen parameters are
uploaded but never produce or download gradients. A packed (quantized) weight is uploaded as its
packed bytes and quantization state and rebuilt on the worker (``packed.py``): its bytes are
those parts' everywhere here, never a dequantized copy's. Tensor hooks on a host parameter run
when its gradient is added, as autograd runs them for a plain module (``accumulate_host_grads``).
"""

from __future__ import annotations

import copy
import sys
from typing import Sequence

import torch
from torch import nn

from ..cost.autocast_cast import device_dtype, download_dtype
from .packed import PackedWeight, packed_weight


class LayerTable:
    """Names and host tensors of one layer's parameters and buffers, as functional_call keys.
    Packed weights are recognised here, once (``packed_weights``: by tensor id); a tensor the
    upload cannot move is refused here, naming it, before any weight is touched."""

    def __init__(self, layer: nn.Module):
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.is_param: list[bool] = []
        self.packed_weights: dict[int, PackedWeight] = {}
        for name, p in layer.named_parameters(remove_duplicate=False):
            self.names.append(name)
            self.tensors.append(p)
            self.is_param.append(True)
        for name, b in layer.named_buffers(remove_duplicate=False):
            self.names.append(name)
            self.tensors.append(b)
            self.is_param.append(False)
        for name, t in zip(self.names, self.tensors):
            packed = packed_weight(t, name)
            if packed is not None:
                self.packed_weights[id(t)] = packed


def tensor_bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``t`` in ``dtype`` (default: its own)."""
    return t.numel() * (dtype or t.dtype).itemsize


class StageWeights:
    """One stage's weights on one worker: chunk uploads, per-layer dicts, trainable leaves."""

    def __init__(
        self,
        tables: Sequence[LayerTable],
        layer_ids: range,
        compute_dtype: torch.dtype | None,
        chunk_bytes: int,
        need_grads: bool,
        shadows=None,
    ):
        self.layer_ids = layer_ids
        seen: dict[int, int] = {}
        self.host: list[torch.Tensor] = []
        self.is_param: list[bool] = []
        # per layer: list of (name, index into self.host)
        self.layout: dict[int, list[tuple[str, int]]] = {}
        self.packed: list[PackedWeight | None] = []  # per host tensor: how it is uploaded packed (None: plain)
        for l in layer_ids:
            table = tables[l]
            entries = []
            for name, t, is_param in zip(table.names, table.tensors, table.is_param):
                key = id(t)
                if key not in seen:
                    seen[key] = len(self.host)
                    self.host.append(t)
                    self.is_param.append(is_param)
                    self.packed.append(table.packed_weights.get(key))
                entries.append((name, seen[key]))
            self.layout[l] = entries
        # What is uploaded: the shadow (compute-dtype copy) where one exists, else the master.
        self.shadows = shadows
        self.sources = [shadows.get(t) if shadows is not None else t for t in self.host]
        # Upload dtypes: a shadow's where there is one (only parameters autocast casts have one under a
        # mixed precision, shadows.py), else the master's.
        self.dtypes = [s.dtype for s in self.sources] if shadows is not None else [
            compute_dtype if (compute_dtype is not None and p and t.is_floating_point()) else t.dtype
            for t, p in zip(self.host, self.is_param)
        ]
        self.trainable = [need_grads and p and t.requires_grad for t, p in zip(self.host, self.is_param)]
        for i, packed in enumerate(self.packed):
            if packed is not None and self.host[i].requires_grad:  # frozen when the table was made, not now
                packed_weight(self.host[i], self._name(i))  # raises the error that says what to do
        # Trainable parameters uploaded in a lower precision than their masters become leaves in the
        # master's dtype on the device (autocast casts them back at use, to the same values): their
        # gradients then add up over microbatches in fp32, as under Lightning's mixed precision.
        self.grad_dtypes = [device_dtype(t, d, tr) for t, d, tr in zip(self.host, self.dtypes, self.trainable)]
        # Downloads: such a gradient (the stage's sum over microbatches, in fp32) is rounded to bf16 once
        # on the device and downloaded in bf16, as each backward call under Lightning's bf16-mixed adds a
        # bf16 gradient (that of autocast's cast) into the fp32 ``.grad`` (cost/autocast_cast.py).
        self.download_dtypes = [download_dtype(g, d) for g, d in zip(self.grad_dtypes, self.dtypes)]
        # Forward stages too upload a parameter that requires grad as requiring grad (no graph is built without
        # grad): some kernels choose their algorithm by it (F.linear on a transposed input, as in
        # nn.MultiheadAttention), so the forward stage computes bit for bit what recompute and the model compute.
        self.grad_flags = [p and t.requires_grad for t, p in zip(self.host, self.is_param)]
        self.nbytes = sum(self._bytes(i, d) for i, d in enumerate(self.dtypes))
        self.grad_bytes = sum(tensor_bytes(t, d) for t, d, tr in zip(self.host, self.grad_dtypes, self.trainable) if tr)
        # What the worker holds once uploaded: the tensors in their device dtypes (fp32 leaves included).
        self.device_nbytes = sum(self._bytes(i, d) for i, d in enumerate(self.grad_dtypes))
        # chunking: consecutive tensors until chunk_bytes is reached
        self.chunks: list[list[int]] = []
        current, size = [], 0
        for i, d in enumerate(self.dtypes):
            current.append(i)
            size += self._bytes(i, d)
            if size >= chunk_bytes:
                self.chunks.append(current)
                current, size = [], 0
        if current or not self.chunks:
            self.chunks.append(current)
        # The weight gradients come home the same way: runs of trainable tensors of about chunk_bytes
        # each (a tensor larger than that is a run of its own), so no download task is a stage's
        # gigabytes at once. A stage with nothing trainable still has one (empty) download: it is
        # what carries a failed microbatch's error to the host.
        self.grad_chunks: list[list[int]] = []
        current, size = [], 0
        for i in self.trainable_indices():
            current.append(i)
            size += tensor_bytes(self.host[i], self.grad_dtypes[i])  # runs as the device holds them: the
            if size >= chunk_bytes:  # engine's byte table, built without the shadows, cuts the same runs
                self.grad_chunks.append(current)
                current, size = [], 0
        if current or not self.grad_chunks:
            self.grad_chunks.append(current)
        self.device: list[torch.Tensor | None] = [None] * len(self.host)
        self._params: dict[int, dict[str, torch.Tensor]] | None = None

    def fresh(self) -> "StageWeights":
        """These weights with nothing uploaded: the same tables (layout, dtypes, chunks), own device slots."""
        new = copy.copy(self)
        new.device = [None] * len(self.host)
        new._params = None
        return new

    def _name(self, i: int) -> str:
        return next((f"layer {l}: {name}" for l, entries in self.layout.items() for name, j in entries if j == i),
                    f"tensor {i}")

    def _bytes(self, i: int, dtype: torch.dtype) -> int:
        """Bytes of host tensor ``i`` as uploaded and held: its packed parts' for a packed weight."""
        packed = self.packed[i]
        return packed.nbytes if packed is not None else tensor_bytes(self.host[i], dtype)

    def upload_sources(self, chunk: list[int]) -> list[torch.Tensor]:
        """What an upload of ``chunk`` reads, once the layers' optimizer steps are in: shadows of
        masters written in place since their last copy are re-copied first (``ShadowStore``)."""
        if self.shadows is not None:
            self.shadows.refresh_edited(self.host[i] for i in chunk)
        return [self.sources[i] for i in chunk]

    def upload_tensors(self, chunk: list[int]) -> tuple[list[torch.Tensor], list[torch.dtype | None], list[bool]]:
        """``(host tensors, dtypes, read-only flags)`` an upload of ``chunk`` copies, for the pool's
        ``copy_to_device``: a plain tensor in its upload dtype (read-only if a parameter: buffers may be
        written in forward), a packed weight as its parts in their own dtypes, read-only (frozen)."""
        tensors: list[torch.Tensor] = []
        dtypes: list[torch.dtype | None] = []
        read_only: list[bool] = []
        for i, src in zip(chunk, self.upload_sources(chunk)):
            packed = self.packed[i]
            parts = [src] if packed is None else packed.host_parts()
            tensors.extend(parts)
            dtypes.extend([self.dtypes[i]] if packed is None else [None] * len(parts))
            read_only.extend([self.is_param[i]] if packed is None else [True] * len(parts))
        return tensors, dtypes, read_only

    def chunk_bytes(self, chunk: list[int]) -> int:
        """Upload bytes of the tensors of ``chunk``, in their upload dtypes (packed weights: their parts)."""
        return sum(self._bytes(i, self.dtypes[i]) for i in chunk)

    def device_chunk_bytes(self, chunk: list[int]) -> int:
        """Bytes the worker holds for ``chunk`` once stored (``store_chunk``): trainable lower-precision
        uploads as fp32 leaves, so more than ``chunk_bytes`` under a mixed precision."""
        return sum(self._bytes(i, self.grad_dtypes[i]) for i in chunk)

    def grad_chunk_bytes(self, chunk: list[int]) -> int:
        """Download bytes of the gradients of ``chunk`` (one of ``grad_chunks``), in their download dtypes."""
        return sum(tensor_bytes(self.host[i], self.download_dtypes[i]) for i in chunk)

    def store_chunk(self, chunk: list[int], device_tensors: list[torch.Tensor]) -> None:
        """Keep the uploaded device tensors of ``chunk`` (as ``upload_tensors`` listed them: packed
        weights as their parts, rebuilt here), trainable ones set to require grad."""
        at = 0
        for i in chunk:
            packed = self.packed[i]
            if packed is not None:
                n = len(packed.host_parts())
                self.device[i] = packed.rebuild(device_tensors[at:at + n])
                at += n
                continue
            t = device_tensors[at]
            at += 1
            if self.trainable[i] and t.dtype != self.grad_dtypes[i]:
                t = t.to(self.grad_dtypes[i])  # an fp32 leaf: gradients accumulate in fp32 (see __init__)
            if self.grad_flags[i] and not t.requires_grad:
                t.requires_grad_(True)
            self.device[i] = t

    def params_for(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s parameters and buffers on the device, by name, for ``functional_call``."""
        if self._params is None:
            self._params = {l: {name: self.device[i] for name, i in entries} for l, entries in self.layout.items()}
        return self._params[layer]

    def trainable_indices(self) -> list[int]:
        """Indices of the trainable tensors."""
        return [i for i, tr in enumerate(self.trainable) if tr]

    def device_grads(self, indices: list[int] | None = None) -> list[torch.Tensor | None]:
        """The device gradients of the trainable tensors (of ``indices`` only, e.g. one of ``grad_chunks``),
        as downloaded: in ``download_dtypes`` (a bf16 copy of an fp32 leaf's gradient made here, on the device)."""
        out = []
        for i in (self.trainable_indices() if indices is None else indices):
            g = self.device[i].grad
            out.append(g if g is None or g.dtype == self.download_dtypes[i] else g.to(self.download_dtypes[i]))
        return out

    def release(self) -> None:
        """Drop the device tensors."""
        self.device = [None] * len(self.host)
        self._params = None


class HostGradBuffers:
    """Persistent host gradient buffers, one per parameter, reused from step to step.

    ``zero_grad(set_to_none=True)`` (Lightning's default) drops ``.grad`` every step, and adding
    the first downloaded gradient would then allocate a fresh tensor per parameter per step (for
    an 8B model, tens of GB of new pages per step). Instead the first gradient of a step is
    copied into this parameter's buffer, which becomes ``.grad`` again. A buffer is reused only
    when nothing else holds it (no ``.grad``, no view, no reference kept by the user or by an
    optimizer step still reading it); otherwise a new one is made, so reuse never changes a
    tensor someone can still see.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self.allocations = 0  # buffers made (not reused): one per parameter in steady state

    def _free(self, key: int) -> bool:
        if key not in self._buffers:
            return False
        held = self._buffers[key]
        # Python references (the dict, ``held``, getrefcount's argument); C++ references to the
        # tensor (a .grad slot, a view's base) and to its storage (views; +1 for the temporary).
        return (sys.getrefcount(self._buffers[key]) == 3 and held._use_count() == 1
                and torch._C._storage_Use_Count(held.untyped_storage()._cdata) == 2)

    def take(self, p: torch.Tensor) -> torch.Tensor:
        """A buffer shaped like ``p`` that nothing else references (reused when possible)."""
        key = id(p)
        if not self._free(key) or self._buffers[key].shape != p.shape or self._buffers[key].dtype != p.dtype:
            self._buffers[key] = torch.empty_like(p, memory_format=torch.contiguous_format)
            self.allocations += 1
        return self._buffers[key]


# The pipeline computes weight gradients on copies of the host parameters, so hooks registered on a
# host parameter would never fire. For a parameter holding one, the downloaded gradient (all
# microbatches of a call, summed) is handed to autograd as the leaf's gradient,
# ``torch.autograd.backward([p], [g])``, which runs its hooks as a single-device backward does, once
# per pipelined call's backward. Where that is not exact (tied parameters across stages):
# docs/design.md, design notes, ``params/weights.py``: tensor hooks.


def has_grad_hooks(p: torch.Tensor) -> bool:
    """True when ``p`` has a gradient hook or a post-accumulate-grad hook registered."""
    return bool(getattr(p, "_backward_hooks", None)) or bool(getattr(p, "_post_accumulate_grad_hooks", None))


def accumulate_with_hooks(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``p.grad`` through autograd, so that ``p``'s hooks run on it.

    ``grad`` must be the caller's own tensor (a hook may keep it, and autograd may adopt it as
    ``p.grad``)."""
    torch.autograd.backward([p], [grad])


def accumulate_host_grads(weights: StageWeights, host_grads: list[torch.Tensor | None], scale: float | None = None,
                          buffers: HostGradBuffers | None = None, indices: list[int] | None = None) -> None:
    """Add a stage's downloaded gradients into the masters' ``.grad`` (fp32), optionally times ``scale``.

    With ``buffers``, a missing ``.grad`` is filled from a persistent buffer instead of a new
    tensor; the arithmetic (a cast, then the scale, then the sum) is the same either way. A
    parameter with tensor hooks gets its gradient through autograd, which runs them (``has_grad_hooks``).
    ``indices``: the tensors ``host_grads`` are of (one of ``weights.grad_chunks``; default: every trainable one).
    """
    for i, g in zip(weights.trainable_indices() if indices is None else indices, host_grads):
        if g is None:
            continue
        p = weights.host[i]
        scaled = scale is not None and scale != 1.0
        if has_grad_hooks(p):  # the user's tensor hooks run on this call's gradient, as autograd would
            own = g.to(p.dtype, copy=True)
            accumulate_with_hooks(p, own.mul_(scale) if scaled else own)
            continue
        if p.grad is None and buffers is not None:
            buf = buffers.take(p)
            buf.copy_(g)
            if scaled:
                buf.mul_(scale)
            p.grad = buf
            continue
        g = g.to(p.dtype)
        if scaled:
            g = g * scale
        if p.grad is None:
            p.grad = g if g.data_ptr() != p.data_ptr() else g.clone()
        else:
            p.grad.add_(g)


def group_by_lowest_layer(tables: Sequence[LayerTable], selected: set[int]) -> tuple[dict, dict]:
    """Group parameters (by id, those in ``selected``) under the lowest pipeline layer holding them.

    A parameter's gradient is complete once every layer holding it has run its backward; since
    backward runs from the last layer down, that is when its lowest layer has. Returns
    ``(unit_params, unit_layers)``: per unit (its lowest layer) the parameters, and the layers
    whose gradients the unit waits for (more than one only for tied parameters).
    """
    layers_of: dict[int, set[int]] = {}
    owner: dict[int, torch.Tensor] = {}
    for l, table in enumerate(tables):
        for t, is_param in zip(table.tensors, table.is_param):
            if is_param and id(t) in selected:
                layers_of.setdefault(id(t), set()).add(l)
                owner[id(t)] = t
    unit_params: dict[int, list[torch.Tensor]] = {}
    unit_layers: dict[int, set[int]] = {}
    for pid, layers in layers_of.items():
        unit = min(layers)
        unit_params.setdefault(unit, []).append(owner[pid])
        unit_layers.setdefault(unit, set()).update(layers)
    return unit_params, unit_layers


def unique_parameters(layers) -> list:
    """The parameters of ``layers``, each once (a tied one where it first appears), in layer order."""
    seen: dict[int, torch.Tensor] = {}
    for layer in layers:
        for p in layer.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())
