"""Packed weights: frozen quantized tensors that a stage uploads as their packed bytes and scales.

Two kinds are known. bitsandbytes' ``Params4bit`` (QLoRA's NF4/FP4 base weights) holds 4-bit
bytes, and its ``quant_state`` the block scales, the code and, with double quantization, a nested
state: neither a parameter nor a buffer, so it travels only because this module lists it. Any
traceable wrapper subclass (torchao's ``NF4Tensor``, as torchtune builds QLoRA) names its inner
tensors with ``__tensor_flatten__``. For each, ``PackedWeight`` gives the plain host tensors an
upload moves and pins, and rebuilds from their device copies the tensor the layer's own forward
takes. Nothing is ever dequantized here, and neither library is imported: a tensor is known by
its class, so the package imports without them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from ..errors import UnsupportedWeightError  # noqa: F401  (re-exported: defined in errors.py)

PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)


def _is_params4bit(t: torch.Tensor) -> bool:
    cls = type(t)
    return cls.__name__ == "Params4bit" and cls.__module__.split(".")[0] == "bitsandbytes"


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage as a plain tensor (no subclass, no autograd history)."""
    return t.detach().as_subclass(torch.Tensor)


def _nbytes(parts: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in parts)


class PackedWeight:
    """One packed tensor: ``host_parts()`` are what an upload moves (read afresh at each call),
    ``rebuild(device_parts)`` the tensor the layer computes with, ``nbytes`` the parts' bytes."""

    kind = "packed"

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.nbytes = _nbytes(self.host_parts())

    def host_parts(self) -> list[torch.Tensor]:
        """The plain host tensors an upload of this weight copies (packed bytes and quantization state)."""
        raise NotImplementedError

    def rebuild(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The weight made of ``parts`` (device copies of ``host_parts()``, in that order)."""
        raise NotImplementedError


class Params4bitWeight(PackedWeight):
    """bitsandbytes' ``Params4bit``: its packed bytes, then every tensor of its ``QuantState``, the
    nested state's (double quantization) after its own. The rebuilt weight is a ``Params4bit``
    whose ``quant_state`` holds the device copies, which ``Linear4bit.forward`` reads."""

    kind = "bitsandbytes Params4bit"

    @staticmethod
    def _state_tensors(state) -> list[tuple[Any, str]]:
        """(owner, attribute) of every tensor of a ``QuantState``, nested states' included, in a fixed order."""
        out = []
        for name, value in vars(state).items():
            if isinstance(value, torch.Tensor):
                out.append((state, name))
            elif type(value) is type(state):  # the nested state of double quantization
                out.extend(Params4bitWeight._state_tensors(value))
        return out

    def host_parts(self) -> list[torch.Tensor]:
        state = self.tensor.quant_state
        if state is None:
            raise UnsupportedWeightError("a bitsandbytes Params4bit without a quant_state is not quantized yet: "
                                         "load the model with its quantization_config (or move it to a device) first")
        return [_plain(self.tensor)] + [getattr(o, n).detach() for o, n in self._state_tensors(state)]

    def rebuild(self, parts: list[torch.Tensor]) -> torch.Tensor:
        w = self.tensor
        state = _copy_state(w.quant_state)
        for (owner, name), part in zip(self._state_tensors(state), parts[1:]):
            setattr(owner, name, part)
        return type(w)(data=parts[0], requires_grad=False, quant_state=state, blocksize=w.blocksize,
                       compress_statistics=w.compress_statistics, quant_type=w.quant_type,
                       quant_storage=w.quant_storage, bnb_quantized=True)


def _copy_state(state):
    """A copy of a ``QuantState`` whose nested states are copies too (tensors still shared)."""
    state = copy.copy(state)
    for name, value in vars(state).items():
        if type(value) is type(state):
            setattr(state, name, _copy_state(value))
    return state


class WrapperSubclassWeight(PackedWeight):
    """A traceable wrapper subclass (torchao's ``NF4Tensor``): its inner tensors by
    ``__tensor_flatten__`` (recursively), rebuilt by ``__tensor_unflatten__`` with its metadata
    placed on the parts' device."""

    kind = "tensor subclass"

    def __init__(self, tensor: torch.Tensor):
        self.names, self.meta = tensor.__tensor_flatten__()
        self.inner = {n: (WrapperSubclassWeight(getattr(tensor, n)) if is_traceable_wrapper_subclass(getattr(tensor, n))
                          else None) for n in self.names}
        self.kind = type(tensor).__name__
        super().__init__(tensor)

    def host_parts(self) -> list[torch.Tensor]:
        parts = []
        for n in self.names:
            nested = self.inner[n]
            parts.extend(nested.host_parts() if nested is not None else [getattr(self.tensor, n).detach()])
        return parts

    def _count(self) -> int:
        return sum(self.inner[n]._count() if self.inner[n] is not None else 1 for n in self.names)

    def rebuild(self, parts: list[torch.Tensor]) -> torch.Tensor:
        inner, at = {}, 0
        for n in self.names:
            nested = self.inner[n]
            take = nested._count() if nested is not None else 1
            inner[n] = nested.rebuild(parts[at:at + take]) if nested is not None else parts[at]
            at += take
        t = self.tensor
        meta = _on_device(self.meta, parts[0].device) if parts else self.meta
        return type(t).__tensor_unflatten__(inner, meta, t.size(), t.stride())


def _on_device(meta: Any, device: torch.device) -> Any:
    """``__tensor_flatten__``'s metadata with every ``device`` field (of a dataclass or named tuple in
    it) set to ``device``: a subclass that records its device there is rebuilt where its parts are."""
    if isinstance(meta, dict):
        return {k: _on_device(v, device) for k, v in meta.items()}
    if dataclasses.is_dataclass(meta) and not isinstance(meta, type) and hasattr(meta, "device"):
        return dataclasses.replace(meta, device=device)
    if isinstance(meta, tuple) and hasattr(meta, "_replace") and hasattr(meta, "device"):
        return meta._replace(device=device)
    return meta


def is_plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is an ordinary tensor, parameter or buffer (no subclass)."""
    return type(t) in PLAIN_TYPES


def packed_weight(t: torch.Tensor, name: str = "a tensor") -> PackedWeight | None:
    """The ``PackedWeight`` of ``t`` (None for a plain tensor). Refuses, naming ``name``, a packed
    tensor that requires grad and a tensor subclass of unknown kind."""
    if is_plain(t):
        return None
    if _is_params4bit(t):
        packed: PackedWeight = Params4bitWeight(t)
    elif is_traceable_wrapper_subclass(t):
        packed = WrapperSubclassWeight(t)
    else:
        raise UnsupportedWeightError(
            f"{name} is a {type(t).__module__}.{type(t).__qualname__}, a tensor subclass the stage upload does not know: "
            f"it moves plain tensors, bitsandbytes 4-bit weights (Params4bit) and traceable wrapper subclasses "
            f"(torchao's NF4Tensor) only, and copying it as a plain tensor would drop what the subclass keeps beside "
            f"its data. Convert it to a plain tensor, or quantize it with one of those (see docs/qlora.md)")
    if t.requires_grad:
        raise UnsupportedWeightError(
            f"{name} is a packed {packed.kind} weight that requires grad: packed base weights are uploaded as their "
            f"packed bytes and never get a gradient. Freeze it ({name.rsplit('.', 1)[-1]}.requires_grad_(False); "
            f"peft's get_peft_model does) and train adapters (LoRA) instead")
    return packed


def cpu_inference_4bit_modules(layers) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the bitsandbytes 4-bit linears of ``layers`` that switch kernels by grad mode on
    CPU: in eval mode, called on a CPU tensor that does not require grad, ``Linear4bit.forward`` repacks its
    weight for bitsandbytes' bf16 CPU inference kernel (AVX512-BF16 CPUs), which computes other numbers
    than the kernel it runs with grad. The pipeline's forward stages run without grad, Lightning's with."""
    return [(f"layer {i}: {name}", m) for i, layer in enumerate(layers) for name, m in layer.named_modules()
            if type(m).__module__.split(".")[0] == "bitsandbytes" and getattr(m, "support_avx512bf16_for_cpu", False)]


def upload_parts(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The host tensors uploads read for ``tensors``: packed ones replaced by their parts (what to pin)."""
    out = []
    for t in tensors:
        packed = None if is_plain(t) else packed_weight(t)
        out.extend(packed.host_parts() if packed is not None else [t])
    return out
