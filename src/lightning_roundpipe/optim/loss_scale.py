"""Loss-scaled gradients unscaled and checked layer by layer, as torch's ``GradScaler`` does them all at once.

``GradScaler.unscale_``'s op is element-wise and only ever sets the found-inf flag, so running it
on each layer's gradients as they complete, into one flag per device for the step, gives the same
values and flag: this lets a layer step before the others have their gradients (``overlap.py``).
``StepUnscale.record`` hands the step's flag to the scaler through its public ``unscale_``, so
``GradScaler.update`` behaves exactly as after ``GradScaler.step``. Details: docs/design.md,
design notes, ``optim/loss_scale.py``.
"""

from __future__ import annotations

import threading

import torch


class StepUnscale:
    """One optimizer step's unscaling: ``1/scale`` fixed at the step's start, a found-inf flag per device."""

    def __init__(self, scaler: "torch.amp.GradScaler"):
        # GradScaler: self._scale.double().reciprocal().float(), its scale an fp32 tensor. get_scale() is
        # that value (or, before the first scale(), the init_scale the tensor will be made from).
        scale = torch.tensor(scaler.get_scale(), dtype=torch.float32)
        self.inv_scale = scale.double().reciprocal().float()
        self._found: dict[torch.device, torch.Tensor] = {}
        self._inv: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._stand_in = None  # kept alive until the scaler's update(): it keys its record by id

    def unscale(self, grads) -> None:
        """Unscale ``grads`` (host gradient tensors, None skipped) in place and note any inf or NaN,
        grouped by device and dtype as ``GradScaler`` groups them."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            if g is None:
                continue
            if g.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")  # GradScaler's own refusal
            values = g._values() if g.is_sparse else g  # noqa: SLF001 (torch's sparse API, as GradScaler)
            groups.setdefault((values.device, values.dtype), []).append(values)
        with torch.no_grad(), self._lock:
            for (device, _), tensors in groups.items():
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, self._flag(device), self._inv_on(device))

    def _flag(self, device: torch.device) -> torch.Tensor:
        if device not in self._found:
            self._found[device] = torch.zeros((), dtype=torch.float32, device=device)
        return self._found[device]

    def _inv_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv:
            self._inv[device] = self.inv_scale.to(device)
        return self._inv[device]

    def overflowed(self) -> bool:
        """Whether any gradient unscaled so far held an inf or a NaN."""
        with self._lock:
            return any(bool(f.item()) for f in self._found.values())

    def record(self, scaler: "torch.amp.GradScaler") -> None:
        """Tell ``scaler`` what this step found, so its next ``update()`` acts as after ``GradScaler.step``."""
        value = float("inf") if self.overflowed() else 0.0
        holder = torch.zeros(1, dtype=torch.float32, device=self.inv_scale.device)
        holder.grad = torch.full((1,), value, dtype=torch.float32, device=holder.device)
        self._stand_in = _OneGradient(holder)
        scaler.unscale_(self._stand_in)


class _OneGradient:
    """The stand-in optimizer ``record`` unscales: one parameter, whose gradient carries the step's flag."""

    def __init__(self, param: torch.Tensor):
        self.param_groups = [{"params": [param]}]
