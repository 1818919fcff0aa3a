"""What one optimizer step changed, kept until the whole step has succeeded, so a failed step is put back.

Layers step one by one on the optimizer lane, some while backward still runs. If anything fails
after some layers stepped (a worker error or timeout later in backward, ``detect_anomaly``, the
optimizer raising for one parameter group), the promise is that the host weights and the
optimizer state are exactly as before the step. So, just before a layer steps, the lane copies
that layer's parameters and their optimizer state (every tensor: Adam's step count and moments);
once the step's last layer has stepped the copies are dropped. The copies are taken on the
optimizer lane, so they hide behind the pipeline with the step itself; they cost host memory of
one parameter copy plus one optimizer-state copy of the layers stepped so far, for at most one step
(measured: +1.6 GiB peak RSS for 100M parameters under AdamW, ``benchmarks/step_undo_cost.py``).

``keep=False`` (the opt-out for models whose host memory cannot hold that copy) keeps only the
names of the layers stepped, so a failure can say which ones changed; the overlapped optimizer
then refuses to step or save until the state is restored from a checkpoint.
"""

from __future__ import annotations

import copy

import torch


def _clone_state(state: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in state.items()}


class StepUndo:
    """The before-images of one step: per stepped parameter its data and optimizer state."""

    def __init__(self, optimizer: torch.optim.Optimizer, keep: bool = True):
        self.optimizer = optimizer
        self.keep = keep
        self.hyper = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.saved: list[tuple[torch.Tensor, torch.Tensor, dict | None]] = []
        self.stepped: list[str] = []  # names of the layer steps done, in order
        self.failure: BaseException | None = None
        self.restored = False

    def nbytes(self) -> int:
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
            before = _clone_state(state[p]) if p in state else None
            self.saved.append((p, p.detach().clone(), before))

    def restore(self) -> list[torch.Tensor]:
        """Put every saved parameter and optimizer state back; return the parameters restored."""
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
                    state[p] = before
                restored.append(p)
        for group, hyper in zip(self.optimizer.param_groups, self.hyper):
            group.update(hyper)  # a scheduler stepped after a step that failed later
        self.saved = []
        self.restored = True
        return restored

    def commit(self) -> None:
        """The step succeeded: drop the before-images."""
        self.saved = []
