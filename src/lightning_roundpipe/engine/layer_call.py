"""What surrounds one call of a pipelined layer on a worker, for every backend.

The inputs a stage differentiates through (fresh leaves for autograd, copies for layers that
write in place), the layer called with the worker's tensors swapped in for its own, the lock of
a module object shared by several layers, the buffers a forward writes sent home once per
microbatch (GPipe), and the user's forward hooks, refused when they keep a layer's output.
Why each rule: docs/design.md, design notes (``engine/layer_call.py``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call
from torch.utils import _pytree as pytree

from ..errors import ForwardHookError, PipelineTimeout
from ..host.compile_clock import wait_excluding_compiles

# ---------------------------------------------------------------------------- stage inputs
# A backward stage (and a fused or graph-keeping forward stage) makes each floating input a fresh
# leaf that requires grad, so that its ``.grad`` is the gradient to pass on. A layer that writes
# its input in place may not write such a leaf, nor the host copy that recompute reads: the
# layers get a copy of each leaf. In forward without grad the input is the worker's own copy.


def _is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def differentiable_inputs(tree: Any, need: bool, keys=None) -> tuple[list, Any]:
    """``(leaves, tree)``: the flattened leaves (floating ones fresh leaves requiring grad when
    ``need``) and the tree to feed the layers (copies of those leaves, safe to write).

    ``keys``: for a dict carry, only the values under these keys get a gradient (the stage's first
    layer's ``differentiable_carry_keys``); rotary tables and masks are then neither
    differentiated nor shipped back.
    """
    if not need:
        leaves, spec = pytree.tree_flatten(tree)
        return leaves, pytree.tree_unflatten(leaves, spec)
    return inputs_at(tree, differentiable_positions(tree, need, keys))


def inputs_at(tree: Any, positions) -> tuple[list, Any]:
    """``differentiable_inputs`` with the positions among the flattened leaves given: those leaves fresh leaves
    requiring grad, and the tree to feed the layers with copies of them."""
    wanted = set(positions)
    leaves, spec = pytree.tree_flatten(tree)
    leaves = [x.detach().requires_grad_(True) if p in wanted else x for p, x in enumerate(leaves)]
    with torch.enable_grad():
        fed = [x.clone() if p in wanted else x for p, x in enumerate(leaves)]
    return leaves, pytree.tree_unflatten(fed, spec)


def differentiable_positions(tree: Any, need: bool, keys=None) -> tuple[int, ...]:
    """The positions among ``tree``'s flattened leaves that get a gradient (``differentiable_inputs``'s rule):
    none unless ``need``; else the floating tensors, under ``keys`` only for a dict carry when given."""
    leaves = pytree.tree_leaves(tree)
    if not need:
        return ()
    if keys is not None and isinstance(tree, dict):
        wanted = pytree.tree_leaves({k: pytree.tree_map(lambda _, k=k: k in keys, v) for k, v in tree.items()})
    else:
        wanted = [True] * len(leaves)
    return tuple(p for p, (x, w) in enumerate(zip(leaves, wanted)) if w and _is_float_tensor(x))


def kept_copy(tree: Any) -> Any:
    """A stage boundary kept for a backward stage's recompute while the forward goes on: a copy,
    since the next layer may write its input in place."""
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


# ---------------------------------------------------------------------------- tensor swap
# ``functional_call`` walks the module for ties and resolves every dotted name on each call (0.22 ms
# per block in a busy 2-worker pipeline). The engine always passes every tensor of the layer, so the
# owner of each name is found once and a call swaps one entry per tensor, falling back to
# ``functional_call`` when the module's structure changed. Compiled layers keep ``functional_call``.

Slot = tuple[nn.Module, str]  # (the submodule that owns the tensor, its name there)


def tensor_slots(layer: nn.Module) -> dict[str, Slot]:
    """Every parameter and buffer name of ``layer`` (as ``named_parameters``/``named_buffers`` spell
    them without removing duplicates) and the submodule that owns it."""
    slots: dict[str, Slot] = {}
    for prefix, module in layer.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for key in store:
                slots[f"{prefix}.{key}" if prefix else key] = (module, key)
    return slots


def swap(owner: nn.Module, key: str, tensor):
    """Put ``tensor`` where ``owner``'s ``key`` lives now (parameters, else buffers, else an attribute);
    return what was there."""
    for store in (owner._parameters, owner._buffers):
        if key in store:
            old = store[key]
            store[key] = tensor
            return old
    old = getattr(owner, key)
    setattr(owner, key, tensor)
    return old


class TensorSwap:
    """Calls of layers with given tensors; the slots of each layer module are found on its first call
    (make one per pipelined call, so a module whose structure changed between calls is read afresh)."""

    def __init__(self) -> None:
        self._slots: dict[int, tuple[nn.Module, dict[str, Slot]]] = {}

    def slots(self, layer: nn.Module) -> dict[str, Slot]:
        """``tensor_slots(layer)``, kept for the later calls of the same module object."""
        entry = self._slots.get(id(layer))
        if entry is None or entry[0] is not layer:
            entry = (layer, tensor_slots(layer))
            self._slots[id(layer)] = entry  # two threads may both fill it: the same slots either way
        return entry[1]

    def call(self, layer: nn.Module, tensors: dict, carry: Any) -> Any:
        """``layer(carry)`` with ``tensors`` (name -> tensor) in place of its own, as
        ``functional_call(layer, tensors, (carry,))`` computes it."""
        slots = self.slots(layer)
        if any(name not in slots for name in tensors):
            return functional_call(layer, tensors, (carry,))
        saved = []
        try:
            for name, tensor in tensors.items():
                owner, key = slots[name]
                saved.append((owner, key, swap(owner, key, tensor)))
            return layer(carry)
        finally:
            for owner, key, own in reversed(saved):  # a name given twice (shared module) ends as it began
                swap(owner, key, own)


# ---------------------------------------------------------------------------- module locks
# A call swaps a module's tensors for its duration, so one module object never runs on two workers
# at once (``engine.py`` gives the layers sharing one a common lock). The wait is bounded by the
# pool's timeout (compile seconds excluded); its error names the layer waiting and the call holding it.


class ModuleLock:
    """A mutex over the layers ``layers`` (indices), which share a module object."""

    __slots__ = ("layers", "_lock", "_holder")

    def __init__(self, layers) -> None:
        self.layers = tuple(layers)
        self._lock = threading.Lock()
        self._holder: tuple | None = None  # (thread, layer, microbatch) of the call inside

    def acquire(self, timeout: float, layer: int, microbatch: int, task_of: Callable[[threading.Thread], str]) -> None:
        """Take the lock for ``layer`` on ``microbatch`` within ``timeout`` seconds, or raise naming who holds
        it."""
        # A free lock is taken at once; only a wait reads the compile clock (16 reads a step otherwise).
        if not self._lock.acquire(blocking=False) and not wait_excluding_compiles(
                lambda left: self._lock.acquire(timeout=left), timeout):
            holder = self._holder
            held = ("another call" if holder is None else
                    f"layer {holder[1]}, microbatch {holder[2]} ({task_of(holder[0])})")
            shared = f" (shared by layers {', '.join(map(str, self.layers))})" if len(self.layers) > 1 else ""
            raise PipelineTimeout(
                f"layer {layer}, microbatch {microbatch} ({task_of(threading.current_thread())}) timed out after "
                f"{timeout:g}s waiting for its module{shared}, which {held} is running: one module object runs one "
                "call at a time, and that call did not return (a hung layer?)")
        self._holder = (threading.current_thread(), layer, microbatch)

    def release(self) -> None:
        """Let the next caller in."""
        self._holder = None
        self._lock.release()


# ---------------------------------------------------------------------------- buffer writes
# GPipe's semantics: after each forward microbatch the buffers it wrote (BatchNorm's running
# statistics) are copied home, one update per microbatch in order; recompute updates only the
# worker's copy. Batch-norm layers are refused with several microbatches unless
# ``batch_statistics="per_microbatch"``; other writers warn once. Writes are seen by version counters.

_warned: set[int] = set()
_warn_lock = threading.Lock()


def expect_buffer_writes(module: torch.nn.Module) -> None:
    """The user accepted per-microbatch buffer updates of ``module`` (``batch_statistics``): no warning."""
    with _warn_lock:
        _warned.add(id(module))


@contextlib.contextmanager
def buffer_writes(weights, layer: int, module: torch.nn.Module, microbatches: int, keep: bool):
    """Around one layer call: when ``keep``, copy the buffers the call wrote back to the host."""
    if not keep:
        yield
        return
    entries = [(weights.device[i], weights.host[i]) for _, i in weights.layout[layer]
               if not weights.is_param[i] and weights.device[i] is not None]
    versions = [dev._version for dev, _ in entries]
    yield
    if all(dev._version == v for (dev, _), v in zip(entries, versions)):
        return
    # Some kernels update a buffer without bumping its version (batch norm's running statistics;
    # its num_batches_tracked does bump): once one buffer of the layer moved, all come home.
    written = entries
    with torch.no_grad():
        for dev, host in written:
            if dev is not host:
                host.copy_(dev)
    if microbatches > 1:
        with _warn_lock:
            if id(module) in _warned:
                return
            _warned.add(id(module))
        warnings.warn(
            f"pipelined layer {layer} ({type(module).__name__}) updates its buffers in forward: with "
            f"microbatches={microbatches} they are updated once per microbatch, in microbatch order (GPipe), and "
            "batch statistics are per microbatch, which differs from a single-device run; use microbatches=1 "
            "for the exact result (batch_statistics='per_microbatch' accepts this for BatchNorm and InstanceNorm "
            "layers, which are refused otherwise)", stacklevel=2)


# ---------------------------------------------------------------------------- forward hooks
# A forward hook runs on a worker, once per microbatch and again in recompute. One that returns or
# edits the output is exact; one that keeps a reference to it (a penalty added to the loss later)
# holds a piece of a worker's graph that backward cannot reach: in a training call it is refused
# at its first call, before any weight changes (seen by the output's reference count).


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
