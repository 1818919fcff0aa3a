"""The fake driver's residency check: a host tensor that a worker's compute reads is an error, as on CUDA.

On the fake driver "device" memory is host memory, so a tensor the stage upload forgot (a module
attribute that is neither a parameter nor a buffer, such as bitsandbytes' ``quant_state``) is read
in place and the step computes the right numbers; on a GPU the same kernel fails with a device
mismatch. With the check on, every storage the driver's uploads make, and every storage an
operator on a worker makes from resident inputs (or from none: a factory), is recorded as
resident; a ``TorchDispatchMode`` around each piece of compute-stream work raises
``HostTensorOnWorkerError`` for an operator that mixes resident inputs with a host one. An
operator on host tensors alone runs on the host, as on CUDA (the engine's RNG bookkeeping);
0-dim tensors (CPU scalars) mix with anything, as CUDA allows, and so do the inputs of
``lift_fresh`` (``torch.tensor(...)`` inside forward). Residency is per process, not per worker.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from lightning_roundpipe.errors import HostTensorOnWorkerError  # noqa: F401  (re-exported: defined in errors.py)

from lightning_roundpipe.workers.completions import TaskLabel

# Operators whose input is a fresh host tensor by construction (``torch.tensor`` inside forward).
LIFTS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


def _plain_tensors(x) -> list[torch.Tensor]:
    """``x`` itself, or a wrapper subclass's inner tensors (recursively)."""
    if not is_traceable_wrapper_subclass(x):
        return [x]
    names, _ = x.__tensor_flatten__()
    return [t for n in names for t in _plain_tensors(getattr(x, n))]


class ResidencyCheck:
    """The storages resident on the workers, and the mode that checks a compute's inputs against them."""

    def __init__(self) -> None:
        self._resident: dict[int, weakref.ref] = {}  # storage data_ptr -> the storage
        self._lock = threading.Lock()
        self._prune_at = 4096  # entries of dead storages are dropped once the table grows past this
        self.checked_ops = 0

    def add(self, t: torch.Tensor) -> None:
        """Record ``t``'s storage (each inner tensor's, for a wrapper subclass) as resident."""
        for p in _plain_tensors(t):
            if p.device.type == "meta":
                continue
            storage = p.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0:
                continue
            with self._lock:
                self._resident[ptr] = weakref.ref(storage)
                if len(self._resident) > self._prune_at:
                    self._resident = {k: r for k, r in self._resident.items() if r() is not None}
                    self._prune_at = max(4096, 2 * len(self._resident))

    def resident(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was uploaded or made on a worker (and is still alive)."""
        storage = t.untyped_storage()
        with self._lock:
            ref = self._resident.get(storage.data_ptr())
        return ref is not None and ref() is storage

    def missing(self, tensors: list[torch.Tensor]) -> tuple[bool, torch.Tensor | None]:
        """``(any resident, first host tensor)`` among ``tensors``' plain tensors; CPU scalars (0-dim) and
        meta tensors count as neither, as CUDA mixes a CPU scalar into any kernel."""
        any_resident, host = False, None
        for t in tensors:
            for p in _plain_tensors(t):
                if p.dim() == 0 or p.device.type == "meta" or p.untyped_storage().data_ptr() == 0:
                    continue
                if self.resident(p):
                    any_resident = True
                elif host is None:
                    host = p
        return any_resident, host

    def running(self, fn: Callable, label: TaskLabel | None = None) -> Callable:
        """``fn`` run under the check (one piece of compute-stream work; its failure is named by the
        worker error as ``label``'s)."""

        def run():
            with ResidencyMode(self):
                return fn()

        return run


class ResidencyMode(TorchDispatchMode):
    """Checks every operator input against ``ResidencyCheck`` and records every output as resident."""

    def __init__(self, check: ResidencyCheck):
        super().__init__()
        self.check = check

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        on_device, host = self.check.missing(inputs)
        if on_device and host is not None and func not in LIFTS:  # the worker error names the task
            raise HostTensorOnWorkerError(
                f"fake CUDA residency check: {func} read a host tensor (shape {tuple(host.shape)}, {host.dtype}) "
                f"beside worker tensors: no upload moved it to the worker, and on CUDA this is a device mismatch. "
                f"The stage upload moves a layer's parameters and buffers (and the parts of packed weights, "
                f"params/packed.py); a tensor kept as a plain module attribute, or inside an object such as a "
                f"quantization state the upload does not know, stays on the host. Register it as a buffer, or "
                f"teach params/packed.py its kind")
        self.check.checked_ops += 1
        out = func(*args, **kwargs)
        # What a kernel on the device makes is on the device; an operator on host tensors alone runs on the
        # host (as on CUDA), and its result stays there. A factory (no tensor input) counts as on the device.
        if on_device or host is None or func in LIFTS:
            for x in pytree.tree_leaves(out):
                if isinstance(x, torch.Tensor):
                    self.check.add(x)
        return out
