"""Whether the failed-step undo's journal fits the host, said at set-up rather than at the first step.

The optimizer's state, the gradient buffers and the undo journal are allocated during the first
steps, so a host too small for them would only show it there (swapping, or the kernel's OOM
killer). ``undo_fit_message`` compares what is still to be allocated with the host's available
memory when the overlapped optimizer is made, and names the figure and the option that fixes it.
"""

from __future__ import annotations

import torch

GiB = 2**30


def available_host_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _state_elements_per_param(optimizer: torch.optim.Optimizer) -> int:
    """Tensors of a parameter's size its optimizer state will hold (Adam's two moments; SGD's momentum)."""
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    return 2  # the Adam family, and a safe guess for the others


def undo_fit_message(optimizer: torch.optim.Optimizer, journal_bytes: int | None, available: int) -> str | None:
    """A warning when the undo journal (``journal_bytes``, None: no bound) and what the first steps
    still allocate (optimizer state, gradient buffers) exceed ``available`` host bytes; None when
    they fit."""
    params = {id(p): p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}.values()
    trainable = sum(p.numel() * p.element_size() for p in params)
    state_now = sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor))
    state_full = state_now or trainable * _state_elements_per_param(optimizer)
    to_come = (state_full - state_now) + sum(p.numel() * p.element_size() for p in params if p.grad is None)
    image = trainable + state_full  # one copy of every parameter and its optimizer state
    journal = image if journal_bytes is None else min(journal_bytes, image)
    if to_come + journal <= available:
        return None
    if to_come <= available:
        fits = available - to_come
        return (f"the failed-step undo journal needs {journal / GiB:.1f} GiB of host memory, and after the optimizer "
                f"state and gradients its first steps allocate ({to_come / GiB:.1f} GiB) this host has "
                f"{fits / GiB:.1f} GiB available: set optimizer_undo_journal_bytes={fits} or less (still exact: "
                "layers past the journal step once the step is known good), or optimizer_undo=False (no undo)")
    return (f"the optimizer state and gradients the first steps allocate ({to_come / GiB:.1f} GiB) and the failed-step "
            f"undo journal ({journal / GiB:.1f} GiB) exceed the {available / GiB:.1f} GiB this host has available: "
            "training will run out of host memory in its first steps; the journal can shrink "
            "(optimizer_undo_journal_bytes=0 keeps the undo exact with no copy) but the state itself does not fit: "
            "train fewer parameters (LoRA) or use a bigger host (python -m lightning_roundpipe.sim plan prices it)")
