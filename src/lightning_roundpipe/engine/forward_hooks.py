"""Forward hooks on pipelined layers: those that keep the output (to use it in the loss) are refused.

A forward hook on a pipelined layer runs on a worker, once per microbatch and again in recompute.
One that returns or edits the output is exact; one that keeps a reference to it (a penalty added
to the loss later) would hold a piece of a worker's graph backward cannot reach, so in a training
call it is refused at its first call, before any weight changes (seen by the output's reference
count). ``HookGuard`` wraps and unwraps the user's hooks. Details: docs/design.md, design notes,
``engine/forward_hooks.py``.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ForwardHookError


class GuardedHook:
    """A user's forward hook, called as registered; a None result raises ``ForwardHookError``."""

    def __init__(self, hook: Callable, where: str, guard: "HookGuard") -> None:
        self.hook = hook
        self.where = where
        self.guard = guard

    def __call__(self, *args: Any) -> Any:
        if not self.guard.training_call:
            return self.hook(*args)
        output = args[-1]
        watched = [output] + ([x for x in output if isinstance(x, torch.Tensor)] if isinstance(output, (tuple, list))
                              else [])
        before = [sys.getrefcount(watched[i]) for i in range(len(watched))]  # counted the same way before and after
        result = self.hook(*args)
        after = [sys.getrefcount(watched[i]) - _held_by(result, watched[i]) for i in range(len(watched))]
        if any(a > b for a, b in zip(after, before)):
            name = getattr(self.hook, "__qualname__", type(self.hook).__name__)
            raise ForwardHookError(
                f"a forward hook ({name}) on {self.where} keeps the layer's output: under RoundPipe a pipelined layer "
                "runs on a worker once per microbatch (and again in the recompute of backward), so a kept output is "
                "one microbatch's worker tensor, which the loss cannot back-propagate through. Return what you need "
                "from the model's forward instead (or compute it from the pipelined module's output), put the hook "
                "on a module outside the pipeline, or keep a detached copy (out.detach()) for reading. Nothing was "
                "updated: the weights are as they were.")
        return result


def _held_by(result: Any, x: Any) -> int:
    """References to ``x`` that the hook's return value holds: itself, items of a returned tuple, and views
    of ``x`` among them (a view holds its base)."""
    items = [result] + (list(result) if isinstance(result, (tuple, list)) else [])
    return sum(r is x for r in items) + sum(isinstance(r, torch.Tensor) and r._base is x for r in items)


class HookGuard:
    """The forward hooks of the pipelined ``layers``, wrapped in ``GuardedHook``."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.training_call = False  # the pipelined call now running was made with grad enabled

    def _hook_tables(self):
        for index, layer in enumerate(self.layers):
            for name, module in layer.named_modules():
                if module._forward_hooks:
                    yield index, name, module, module._forward_hooks

    def wrap_new(self, training_call: bool) -> None:
        """Wrap every hook not wrapped yet (a few dict reads per module when there is none), for a call made
        with grad enabled (``training_call``: hooks keeping the output are refused) or not."""
        self.training_call = training_call
        for index, name, module, hooks in self._hook_tables():
            for key, hook in list(hooks.items()):
                if not isinstance(hook, GuardedHook):
                    where = f"pipelined layer {index}" + (f" (its `{name}`, {type(module).__name__})" if name
                                                          else f" ({type(module).__name__})")
                    hooks[key] = GuardedHook(hook, where, self)

    def unwrap(self) -> None:
        """Give every wrapped hook back as the user registered it."""
        for _, _, _, hooks in self._hook_tables():
            for key, hook in list(hooks.items()):
                if isinstance(hook, GuardedHook):
                    hooks[key] = hook.hook
