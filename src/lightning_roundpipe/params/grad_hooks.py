"""Tensor hooks on host parameters, run as autograd would run them for a plain module.

The pipeline computes weight gradients on copies of the host parameters, so hooks registered on
a host parameter would never fire. For a parameter holding one, the downloaded gradient (all
microbatches of a call, summed) is handed to autograd as the leaf's gradient,
``torch.autograd.backward([p], [g])``, which runs its hooks exactly as a single-device backward
does, once per pipelined call's backward. Where that is not exact (tied parameters across
stages): docs/design.md, design notes, ``params/grad_hooks.py``.
"""

from __future__ import annotations

import torch


def has_grad_hooks(p: torch.Tensor) -> bool:
    """True when ``p`` has a gradient hook or a post-accumulate-grad hook registered."""
    return bool(getattr(p, "_backward_hooks", None)) or bool(getattr(p, "_post_accumulate_grad_hooks", None))


def accumulate_with_hooks(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``p.grad`` through autograd, so that ``p``'s hooks run on it.

    ``grad`` must be the caller's own tensor (a hook may keep it, and autograd may adopt it as
    ``p.grad``)."""
    torch.autograd.backward([p], [grad])
