"""What one optimizer step changed, kept until the whole step has succeeded, so a failed step is put back.

Layers step one by one on the optimizer lane, some while backward still runs. If anything fails
after some layers stepped (a worker error or timeout later in backward, ``detect_anomaly``, the
optimizer raising for one parameter group), the promise is that the host weights and the
optimizer state are exactly as before the step. So, just before a layer steps, the lane copies
that layer's parameters and their optimizer state (every tensor: Adam's step count and moments);
once the step's last layer has stepped the copies are no longer needed.

The copies land in :class:`BeforeImages`, buffers allocated once per tensor and reused every
step: a fresh copy per step would fault in (and zero) new pages for all of them each time,
which costs about as much as the copy itself. They hold one copy of the parameters and of their
optimizer state for as long as the optimizer is overlapped (a fresh copy per step held the same
at the step's peak). The copies are taken on the optimizer lane, so they hide behind the
pipeline with the step itself.

``keep=False`` (the opt-out for models whose host memory cannot hold that copy) keeps only the
names of the layers stepped, so a failure can say which ones changed; the overlapped optimizer
then refuses to step or save until the state is restored from a checkpoint.
"""

from __future__ import annotations

import copy
import threading

import torch

_DATA = "__data__"  # the parameter's own values, beside its optimizer state keys


class BeforeImages:
    """Reused copy buffers, one per (parameter, what: its data or a state key)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._lock = threading.Lock()  # the host thread saves the parameters outside the pipeline meanwhile
        self.allocations = 0  # buffers made: one per copied tensor once every layer has stepped twice

    def copy_of(self, p: torch.Tensor, what: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` copied into the buffer of (``p``, ``what``), made (or remade) to its shape and dtype."""
        key = (id(p), what)
        with self._lock:
            buf = self._buffers.get(key)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype or buf.device != value.device:
            buf = torch.empty_like(value, memory_format=torch.contiguous_format)
            with self._lock:
                self._buffers[key] = buf
                self.allocations += 1
        buf.copy_(value.detach())
        return buf

    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._buffers.values())


class StepUndo:
    """The before-images of one step: per stepped parameter its data and optimizer state."""

    def __init__(self, optimizer: torch.optim.Optimizer, keep: bool = True, images: BeforeImages | None = None):
        self.optimizer = optimizer
        self.keep = keep
        self.images = images if images is not None else BeforeImages()
        self.hyper = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        # per stepped parameter: (parameter, its data's copy, its state before: key -> copy; None: had none)
        self.saved: list[tuple[torch.Tensor, torch.Tensor, dict | None]] = []
        self._saved_ids: set[int] = set()
        self.stepped: list[str] = []  # names of the layer steps done, in order
        self.failure: BaseException | None = None
        self.restored = False

    def nbytes(self) -> int:
        """Bytes of the copies this step holds."""
        total = 0
        for _, data, state in self.saved:
            total += data.numel() * data.element_size()
            for v in (state or {}).values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    def save(self, params, name: str) -> None:
        """Before-image of ``params`` (called on the lane just before their step)."""
        self.stepped.append(name)
        if not self.keep:
            return
        state = self.optimizer.state
        for p in params:
            if id(p) in self._saved_ids:
                continue  # its first before-image is the one to go back to (and the buffer is shared)
            self._saved_ids.add(id(p))
            before = None
            if p in state:
                before = {k: (self.images.copy_of(p, k, v) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                          for k, v in state[p].items()}
            self.saved.append((p, self.images.copy_of(p, _DATA, p), before))

    def restore(self) -> list[torch.Tensor]:
        """Put every saved parameter and optimizer state back; return the parameters restored.

        Values are copied back into the optimizer's own state tensors where the step left one of
        the same shape (the buffers stay ours, for the next step); a state entry the step made
        or replaced otherwise gets a fresh copy."""
        if not self.keep:
            return []
        state = self.optimizer.state
        restored = []
        with torch.no_grad():
            for p, data, before in reversed(self.saved):
                p.copy_(data)
                if before is None:
                    state.pop(p, None)
                else:
                    now = state.get(p, {})
                    put = {}
                    for k, v in before.items():
                        if not isinstance(v, torch.Tensor):
                            put[k] = v
                        elif (isinstance(now.get(k), torch.Tensor) and now[k].shape == v.shape
                              and now[k].dtype == v.dtype and now[k].device == v.device):
                            put[k] = now[k].copy_(v)
                        else:
                            put[k] = v.clone()
                    state[p] = put
                restored.append(p)
        for group, hyper in zip(self.optimizer.param_groups, self.hyper):
            group.update(hyper)  # a scheduler stepped after a step that failed later
        self.saved = []
        self.restored = True
        return restored

    def commit(self) -> None:
        """The step succeeded: the before-images are no longer needed (their buffers serve the next step)."""
        self.saved = []
