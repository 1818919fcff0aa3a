"""Early-stop recompute: a layer recomputed and back-propagated as one compiled ``torch.func.vjp`` graph.

A backward stage's last layer's output is never read by its own backward, so its forward and
backward are traced together and inductor drops the forward work only that output needs (a
decoder layer's MLP down projection: 20-25% of its forward FLOPs), as torch's checkpoint does
with ``set_checkpoint_early_stop``. Compiled, counted and exact as ``compiled_layers.py``; a
one-off meta trace keeps ``None`` gradients where autograd would. A layer that cannot be traced
fails with ``EarlyStopUnsupported`` when the option was asked for, else recomputes whole. Details:
docs/design.md, design notes, ``engine/early_stop.py``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp
from torch.utils import _pytree as pytree

from ..errors import EarlyStopUnsupported, PipelineError
from .compile_keys import CompileKey, KeyedCompiles, device_of
from .compiled_layers import INDUCTOR_OPTIONS

Autocast = tuple[str, bool, Any]  # (device type, enabled, dtype) of the forward
log = logging.getLogger("lightning_roundpipe")


def _autocast(autocast: Autocast):
    device_type, enabled, dtype = autocast
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def _layer_vjp(layer: nn.Module, trainable: dict, fixed: dict, carry: Any, diff_pos: tuple, out_pos: tuple,
               out_grads: tuple, autocast: Autocast):
    """Gradients of the layer's outputs at ``out_pos`` (cotangents ``out_grads``) with respect to
    ``trainable`` and the carry leaves at ``diff_pos``; the outputs themselves are not returned."""
    leaves, spec = pytree.tree_flatten(carry)

    def forward(params, diffs):
        fed = list(leaves)
        for p, x in zip(diff_pos, diffs):
            fed[p] = x.clone()  # a layer may write its input in place
        with _autocast(autocast):
            out = functional_call(layer, {**fixed, **params}, (pytree.tree_unflatten(fed, spec),))
        outs = pytree.tree_leaves(out)
        return tuple(outs[i] for i in out_pos)

    outs, back = vjp(forward, trainable, tuple(leaves[p] for p in diff_pos))
    return back(tuple(g.to(o.dtype) for g, o in zip(out_grads, outs)))


def _meta(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return torch.empty_like(x, device="meta").requires_grad_(grad)


class EarlyStopBackward:
    """The compiled vjp of each layer class, shared by every engine of the process; which weights and inputs
    each layer's outputs reach (checked once per layer module and signature); the seconds of each first call of a
    signature, compile included (``compiles``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._vjps = KeyedCompiles(_layer_vjp, "early_stop", INDUCTOR_OPTIONS)
        self._reach: dict[tuple, tuple[nn.Module, frozenset, frozenset]] = {}
        self._unsupported: dict[tuple, tuple[nn.Module, EarlyStopUnsupported]] = {}
        self._told: set[type] = set()  # layer classes logged as recomputing whole (``grads``, not required)
        self._seen: set[tuple] = set()
        self.compiles: list[tuple[str, float]] = []  # (what compiled, seconds of its first call)

    def graphs(self) -> dict[str, int]:
        """Graphs dynamo holds per compiled vjp (``early_stop_<class>_<device>_grad[_<autocast>]``)."""
        return self._vjps.graphs()

    def recompiles(self) -> int:
        """Graphs beyond the first of each compiled vjp: new shapes or input/output positions of one key."""
        return sum(max(0, n - 1) for n in self.graphs().values())

    def reached(self, layer: nn.Module, trainable: dict, fixed: dict, leaves: list, spec, diff_pos: tuple,
                out_pos: tuple, autocast: Autocast, key: tuple) -> tuple[frozenset, frozenset]:
        """``(weight names, input positions)`` the outputs at ``out_pos`` depend on, traced once on meta tensors."""
        with self._lock:
            hit = self._reach.get(key)
            failed = self._unsupported.get(key)
        if hit is not None and hit[0] is layer:
            return hit[1], hit[2]
        if failed is not None and failed[0] is layer:
            raise failed[1]
        meta_params = {n: _meta(p, True) for n, p in trainable.items()}
        meta_fixed = {n: _meta(p, False) if isinstance(p, torch.Tensor) else p for n, p in fixed.items()}
        meta_leaves = [_meta(x, i in diff_pos) if isinstance(x, torch.Tensor) else x for i, x in enumerate(leaves)]
        try:
            with torch.enable_grad(), _autocast(autocast):
                out = functional_call(layer, {**meta_fixed, **meta_params}, (pytree.tree_unflatten(meta_leaves, spec),))
            outs = [o for i, o in enumerate(pytree.tree_leaves(out)) if i in out_pos and isinstance(o, torch.Tensor)
                    and o.requires_grad]
            inputs = list(meta_params.values()) + [meta_leaves[p] for p in diff_pos]
            grads = (torch.autograd.grad(outs, inputs, [torch.empty_like(o) for o in outs], allow_unused=True)
                     if outs else [None] * len(inputs))
        except Exception as exc:
            error = EarlyStopUnsupported(
                f"recompute_early_stop cannot check which weights layer {type(layer).__name__} uses: its forward does "
                f"not run on meta tensors ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}), "
                "as a layer with data-dependent shapes (Hugging Face's MoE expert loop) does not. Set "
                "recompute_early_stop=False (RoundPipeStrategy(recompute_early_stop=False), or "
                "strategy.recompute_early_stop=false in the Hydra config); moe_experts='grouped' has no "
                "data-dependent shapes. The failed step changed no weight.")
            with self._lock:
                self._unsupported[key] = (layer, error)
            raise error from exc
        names = list(meta_params)
        weights = frozenset(n for n, g in zip(names, grads) if g is not None)
        positions = frozenset(p for p, g in zip(diff_pos, grads[len(names):]) if g is not None)
        with self._lock:
            self._reach[key] = (layer, weights, positions)
        return weights, positions

    def grads(self, layer: nn.Module, params: dict, carry: Any, diff_pos: tuple, out_grads: list,
              autocast: Autocast, required: bool = True) -> tuple[dict, list] | None:
        """Back-propagate ``out_grads`` (aligned with the layer's output leaves; None: no gradient) through
        ``layer`` run on ``carry`` with ``params`` (name -> device tensor), recomputing only what the gradients
        need. Returns ``(weight gradients by name, input gradients aligned with carry's leaves)``, None where
        autograd would leave None: for the weights that do not require grad, and for those and the inputs at
        ``diff_pos`` the outputs do not reach. A layer whose reach cannot be traced raises ``EarlyStopUnsupported``
        (before any compute), or with ``required`` False gets None back, its class logged once. Call it under the
        layer's lock: the meta trace swaps the module's tensors."""
        leaves, spec = pytree.tree_flatten(carry)
        out_pos = tuple(i for i, g in enumerate(out_grads) if g is not None)
        trainable = {n: p.detach() for n, p in params.items() if isinstance(p, torch.Tensor) and p.requires_grad}
        fixed = {n: (p.detach() if isinstance(p, torch.Tensor) else p) for n, p in params.items() if n not in trainable}
        leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
        shapes = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None for x in leaves)
        key = (id(layer), diff_pos, out_pos, autocast, shapes)
        try:
            weights, positions = self.reached(layer, trainable, fixed, leaves, spec, diff_pos, out_pos, autocast, key)
        except EarlyStopUnsupported as exc:
            if required:
                raise
            with self._lock:
                first = type(layer) not in self._told
                self._told.add(type(layer))
            if first:
                log.info("recompute_early_stop: %s layers recompute whole (their forward does not run on meta "
                         "tensors: %s); exact as without the option", type(layer).__name__, exc.__cause__)
            return None
        in_grads: list = [None] * len(leaves)
        if not out_pos:
            return {}, in_grads
        device_type, enabled, dtype = autocast
        compile_key = CompileKey(type(layer), device_of(leaves, trainable), True, ((device_type, dtype),) if enabled else ())
        signature = (compile_key,) + key[1:]  # what a compile depends on besides the module's structure
        first = signature not in self._seen
        start = time.perf_counter()
        weight_grads, input_grads = self._vjps.call(compile_key, layer, trainable, fixed, pytree.tree_unflatten(leaves, spec),
                                                    diff_pos, out_pos, tuple(out_grads[i] for i in out_pos), autocast)
        if first:
            with self._lock:
                if signature not in self._seen:
                    self._seen.add(signature)
                    self.compiles.append((f"{type(layer).__name__} vjp on {compile_key.device}",
                                          time.perf_counter() - start))
        for p, g in zip(diff_pos, input_grads):
            in_grads[p] = g if p in positions else None
        return {n: g for n, g in weight_grads.items() if n in weights}, in_grads

EARLY_STOP = EarlyStopBackward()
"""The process's compiled layer vjps (dynamo's cache is process-wide too)."""


def accumulate(params: dict, weight_grads: dict) -> None:
    """Add ``weight_grads`` (name -> gradient) into the ``.grad`` of ``params``' tensors, as autograd's
    accumulation does (the first gradient stored, later ones added in place)."""
    for name, g in weight_grads.items():
        p = params[name]
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g
