"""Forward hooks on pipelined layers: those that replace the output work, those that only look are refused.

A forward hook registered on a pipelined layer (or a module inside one) runs where the layer runs: on
a worker, once per microbatch, and again in the recompute of backward, with the worker's tensors.
A hook that returns a replacement output is exact: what it returns flows through the pipeline. A hook
that returns None can only act by side effect, typically keeping the output to use it later (a
penalty on an activation added to the loss): that kept tensor is a microbatch's piece of a worker's
graph, which backward cannot reach (torch: "Trying to backward through the graph a second time"), or
no gradient at all. So in a call made with grad enabled (training) such a hook is refused at its
first call, with a message that says what to do, before any weight changes (on the host, in the
split-invariance check, when that runs first). In a call without grad (evaluation, reading hidden
states) it runs, once per microbatch, on that microbatch's rows.

``HookGuard.wrap_new`` wraps every forward hook found on the layers at each pipelined call (the hook's
own handle still removes it); ``unwrap`` puts the user's hooks back at detach.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn


class ForwardHookError(RuntimeError):
    """A forward hook on a pipelined layer returned None (it keeps or reads the output); nothing was updated."""


class GuardedHook:
    """A user's forward hook, called as registered; a None result raises ``ForwardHookError``."""

    def __init__(self, hook: Callable, where: str, guard: "HookGuard") -> None:
        self.hook = hook
        self.where = where
        self.guard = guard

    def __call__(self, *args: Any) -> Any:
        result = self.hook(*args)
        if result is None and self.guard.training_call:
            name = getattr(self.hook, "__qualname__", type(self.hook).__name__)
            raise ForwardHookError(
                f"a forward hook ({name}) on {self.where} returned None: under RoundPipe a pipelined layer runs on a "
                "worker once per microbatch (and again in the recompute of backward), so a hook that keeps or reads "
                "its output sees one microbatch's worker tensors, which the loss cannot back-propagate through. "
                "Return what you need from the model's forward instead (or compute it from the pipelined module's "
                "output), put the hook on a module outside the pipeline, or make the hook return the (possibly "
                "replaced) output, which then flows through the pipeline exactly. Nothing was updated: the weights "
                "are as they were.")
        return result


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
        with grad enabled (``training_call``: hooks returning None are refused) or not."""
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
