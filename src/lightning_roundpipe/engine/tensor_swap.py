"""A layer called with a worker's tensors in place of its own parameters and buffers (eager layers).

``torch.func.functional_call`` does this for any module, but walks the module for ties and
resolves every dotted name on each call: 0.22 ms per block in a busy 2-worker pipeline. The
engine always passes every tensor of the layer, so the owner of each name is found once and the
call swaps one entry per tensor, runs the layer and puts the module's tensors back (also when it
raises), falling back to ``functional_call`` when the module's structure changed. Compiled layers
keep ``functional_call``. Why: docs/design.md, design notes, ``engine/tensor_swap.py``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.func import functional_call

Slot = tuple[nn.Module, str]  # (the submodule that owns the tensor, its name there)


def tensor_slots(layer: nn.Module) -> dict[str, Slot]:
    """Every parameter and buffer name of ``layer`` (as ``named_parameters``/``named_buffers`` spell
    them without removing duplicates) and the submodule that owns it."""
    slots: dict[str, Slot] = {}
    for prefix, module in layer.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for key in store:
                slots[f"{prefix}.{key}" if prefix else key] = (module, key)
    return slots


def swap(owner: nn.Module, key: str, tensor):
    """Put ``tensor`` where ``owner``'s ``key`` lives now (parameters, else buffers, else an attribute);
    return what was there."""
    for store in (owner._parameters, owner._buffers):
        if key in store:
            old = store[key]
            store[key] = tensor
            return old
    old = getattr(owner, key)
    setattr(owner, key, tensor)
    return old


class TensorSwap:
    """Calls of layers with given tensors; the slots of each layer module are found on its first call
    (make one per pipelined call, so a module whose structure changed between calls is read afresh)."""

    def __init__(self) -> None:
        self._slots: dict[int, tuple[nn.Module, dict[str, Slot]]] = {}

    def slots(self, layer: nn.Module) -> dict[str, Slot]:
        """``tensor_slots(layer)``, kept for the later calls of the same module object."""
        entry = self._slots.get(id(layer))
        if entry is None or entry[0] is not layer:
            entry = (layer, tensor_slots(layer))
            self._slots[id(layer)] = entry  # two threads may both fill it: the same slots either way
        return entry[1]

    def call(self, layer: nn.Module, tensors: dict, carry: Any) -> Any:
        """``layer(carry)`` with ``tensors`` (name -> tensor) in place of its own, as
        ``functional_call(layer, tensors, (carry,))`` computes it."""
        slots = self.slots(layer)
        if any(name not in slots for name in tensors):
            return functional_call(layer, tensors, (carry,))
        saved = []
        try:
            for name, tensor in tensors.items():
                owner, key = slots[name]
                saved.append((owner, key, swap(owner, key, tensor)))
            return layer(carry)
        finally:
            for owner, key, own in reversed(saved):  # a name given twice (shared module) ends as it began
                swap(owner, key, own)
