"""Host shadows: compute-dtype copies of the fp32 masters that the workers upload.

Under ``bf16-mixed`` / ``16-mixed`` only the parameters autocast casts at every use go up in the
compute dtype; a shadow per parameter, refreshed by its layer's optimizer step and pinned, saves a
conversion and a pageable copy per upload. Edits outside optimizer steps are followed by version
counters (``follow_edits``); one flat buffer per dtype holds every shadow, so pinning is one
registration; the ``pinned`` policy (``alloc``, ``register``, ``off``) decides what is locked. Why
each choice: docs/design.md, design notes, ``params/shadows.py``.
"""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

import torch
from torch import nn

from ..cost.autocast_cast import autocast_cast_parameters
from .packed import is_plain


class ShadowStore:
    """Shadows of floating parameters, keyed by the master tensor's id, in flat buffers.

    ``pin``: register the flat buffers as pinned memory right away (CUDA only; the stream pools'
    ``pin_uploads`` is the usual way, through the pinned policy). ``follow_edits``: uploads re-copy
    masters written since their last copy (``refresh_edited``); False for ``staleness=1``, whose
    shadows hold the previous version on purpose."""

    def __init__(self, params: Iterable[torch.Tensor], dtype: torch.dtype | None, pin: bool = False,
                 follow_edits: bool = True, keep_dtype: frozenset[int] | set[int] = frozenset()):
        self.dtype = dtype
        self.follow_edits = follow_edits
        self._copied_at: dict[int, int] = {}  # master id -> its version counter when last copied
        self._lock = threading.Lock()  # worker upload threads and the optimizer lane refresh concurrently
        self.shadows: dict[int, torch.Tensor] = {}
        self.masters: dict[int, torch.Tensor] = {}
        unique = []
        for p in params:
            if id(p) in self.masters or not p.is_floating_point() or not is_plain(p):  # packed: uploaded as is
                continue
            self.masters[id(p)] = p
            unique.append(p)
        self._flat: dict[torch.dtype, torch.Tensor] = {}
        self.edits_followed = 0  # masters re-copied because they were written outside a refresh
        sizes: dict[torch.dtype, int] = {}
        own = lambda p: p.dtype if id(p) in keep_dtype else (dtype or p.dtype)  # noqa: E731
        for p in unique:
            dt = own(p)
            sizes[dt] = sizes.get(dt, 0) + p.numel()
        offsets = {dt: 0 for dt in sizes}
        for dt, n in sizes.items():
            self._flat[dt] = torch.empty(n, dtype=dt)
        with torch.no_grad():
            for p in unique:
                dt = own(p)
                off = offsets[dt]
                # Its own tensor on the shared storage, not a view: a view shares the buffer's
                # version counter, so refreshing one layer's shadow would look to autograd like a
                # write into every other layer's weights saved for backward.
                s = torch.empty(0, dtype=dt).set_(self._flat[dt].untyped_storage(), off, p.shape)
                offsets[dt] = off + p.numel()
                s.copy_(p)
                self.shadows[id(p)] = s
                self._copied_at[id(p)] = p._version
        self.registered = register_pinned(self._flat.values()) if pin else []

    @classmethod
    def for_uploads(cls, masters: Sequence[torch.Tensor], layers: Sequence[nn.Module], dtype: torch.dtype | None,
                    staleness: int) -> "ShadowStore":
        """The store a runtime's uploads read: compute-dtype copies of the parameters autocast casts
        (``autocast_cast_parameters``; the others are uploaded as their masters), or with
        ``staleness=1`` previous-version copies of every parameter, in the compute dtype only for those."""
        cast = autocast_cast_parameters(layers) if dtype is not None else set()
        if staleness:
            return cls(masters, dtype, follow_edits=False, keep_dtype={id(p) for p in masters if id(p) not in cast})
        return cls([p for p in masters if id(p) in cast], dtype)

    def upload_tensors(self, masters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """What the uploads of ``masters`` read: the flat shadow buffers, and the masters without a shadow."""
        return self.buffers() + [p for p in masters if id(p) not in self.shadows]

    def get(self, tensor: torch.Tensor) -> torch.Tensor:
        """The shadow copy of ``tensor`` uploads read, or ``tensor`` itself when it has none."""
        return self.shadows.get(id(tensor), tensor)

    def copies_of(self, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Copies of the shadows of ``params``, keyed by position in ``params`` (those without a shadow left
        out): with ``staleness=1`` the weights the next step's gradient is taken at, for a checkpoint."""
        return {i: self.get(p).clone() for i, p in enumerate(params) if self.get(p) is not p}

    def load_copies(self, params: list[torch.Tensor], saved: dict) -> None:
        """Put back what ``copies_of(params)`` returned (keys may be strings, as a checkpoint gives them)."""
        with torch.no_grad():
            for i, value in saved.items():
                self.get(params[int(i)]).copy_(value)

    def buffers(self) -> list[torch.Tensor]:
        """The flat buffers holding every shadow: what the uploads read."""
        return list(self._flat.values())

    def refresh(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Copy the masters (or ``params``) into their shadows."""
        with torch.no_grad(), self._lock:
            for p in (params if params is not None else self.masters.values()):
                s = self.shadows.get(id(p))
                if s is not None:
                    s.copy_(p)
                    self._copied_at[id(p)] = p._version

    def refresh_edited(self, masters: Iterable[torch.Tensor]) -> int:
        """Before an upload of ``masters``: re-copy those written in place since their last copy
        (``follow_edits``; nothing otherwise). Returns how many were re-copied."""
        if not self.follow_edits:
            return 0
        copied = 0
        with torch.no_grad(), self._lock:
            for p in masters:
                seen = self._copied_at.get(id(p))
                if seen is not None and seen != p._version:
                    self.shadows[id(p)].copy_(p)
                    self._copied_at[id(p)] = p._version
                    copied += 1
        self.edits_followed += copied
        return copied

    def nbytes(self) -> int:
        """Host bytes the shadows take."""
        return sum(b.numel() * b.element_size() for b in self._flat.values())

    def close(self) -> None:
        """Unpin what this store pinned."""
        if self.registered:
            unregister_pinned(self.registered)
            self.registered = []


def register_pinned(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Pin existing host tensors in place (CUDA only); returns those registered, for unregistering.
    Through the process's pin registry: errors checked, cleared and counted, no page registered twice."""
    from ..workers.pinning import cuda_pin_registry  # CUDA only: imported where used

    registry = cuda_pin_registry()
    return [t for t in tensors if registry.register(t)]


def unregister_pinned(tensors: Iterable[torch.Tensor]) -> None:
    """Unpin host tensors pinned in place (``cudaHostRegister``)."""
    from ..workers.pinning import cuda_pin_registry

    registry = cuda_pin_registry()
    for t in tensors:
        registry.unregister(t)
