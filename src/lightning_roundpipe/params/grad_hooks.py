"""Tensor hooks on host parameters, run as autograd would run them for a plain module.

The pipeline computes a stage's weight gradients on a worker, on copies of the host parameters,
so autograd never reaches the host parameter itself: a ``p.register_hook(fn)`` (which may edit
or replace the gradient) and a ``p.register_post_accumulate_grad_hook(fn)`` (which sees
``p.grad`` after the sum) would never fire. For a parameter holding either, the downloaded
gradient (all microbatches of one pipelined call, summed) is handed to autograd as the
gradient of the leaf: ``torch.autograd.backward([p], [g])`` runs ``p``'s gradient hooks, adds
the result into ``p.grad`` and runs its post-accumulate hooks, exactly as a single-device
backward does, once per pipelined call's backward.

Not exact only where the single-device run would sum contributions before the hooks and the
pipeline cannot: a parameter tied across two backward stages, or one pipelined module called
twice in one backward, fires the hook once per stage / call (with each part); a hook that is
linear in the gradient (scaling, masking, zeroing) gives the same result either way.

PyTorch has no public query for "does this tensor have hooks", so ``has_grad_hooks`` reads the
two dictionaries ``register_hook`` and ``register_post_accumulate_grad_hook`` fill.
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
