"""Host shadows: compute-dtype copies of the fp32 masters that the workers upload.

With ``bf16-mixed`` the pipeline uploads bf16 weights. Casting the fp32 masters on every
upload would cost a conversion per stage per step (and, on CUDA, a pageable copy); instead each
parameter has a bf16 shadow, refreshed as part of its layer's optimizer step, and pinned so the
copy to the GPU is asynchronous. With ``staleness=1`` shadows (in the parameter dtype) also
hold the previous version of the weights while the optimizer writes the next one.

Pinned-memory policy (``pinned``): ``alloc`` allocates shadows (and download buffers) in pinned
memory: fastest copies, but pinned memory is taken from the OS and cannot be swapped;
``register`` pins the existing master tensors in place with ``cudaHostRegister`` (no extra
copy, but registration is slow to set up and pins the masters too); ``off`` keeps everything
pageable (least pinned memory, slower and synchronous host-to-device copies). On the CPU
backend pinning does not exist and the policy changes nothing.
"""

from __future__ import annotations

from typing import Iterable

import torch

PINNED_POLICIES = ("alloc", "register", "off")


def check_pinned_policy(policy: str) -> str:
    if policy not in PINNED_POLICIES:
        raise ValueError(f"RoundPipeStrategy(pinned={policy!r}): use one of {', '.join(PINNED_POLICIES)}")
    return policy


class ShadowStore:
    """Shadows of floating parameters, keyed by the master tensor's id."""

    def __init__(self, params: Iterable[torch.Tensor], dtype: torch.dtype | None, pin: bool = False):
        self.dtype = dtype
        self.pin = pin
        self.shadows: dict[int, torch.Tensor] = {}
        self.masters: dict[int, torch.Tensor] = {}
        for p in params:
            if id(p) in self.shadows or not p.is_floating_point():
                continue
            dt = dtype or p.dtype
            s = torch.empty(p.shape, dtype=dt, pin_memory=pin)
            with torch.no_grad():
                s.copy_(p)
            self.shadows[id(p)] = s
            self.masters[id(p)] = p

    def get(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.shadows.get(id(tensor), tensor)

    def refresh(self, params: Iterable[torch.Tensor] | None = None) -> None:
        with torch.no_grad():
            for p in (params if params is not None else self.masters.values()):
                s = self.shadows.get(id(p))
                if s is not None:
                    s.copy_(p)

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shadows.values())


def register_pinned(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Pin existing host tensors in place (CUDA only); returns those registered, for unregistering."""
    done = []
    cudart = torch.cuda.cudart()
    for t in tensors:
        if t.device.type == "cpu" and not t.is_pinned() and t.is_contiguous():
            err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(err) == 0:
                done.append(t)
    return done


def unregister_pinned(tensors: Iterable[torch.Tensor]) -> None:
    cudart = torch.cuda.cudart()
    for t in tensors:
        cudart.cudaHostUnregister(t.data_ptr())
