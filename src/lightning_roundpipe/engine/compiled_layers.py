"""Layers run through ``torch.compile`` on the workers (``compile_layers``: True, or None on GPUs).

Eager Hugging Face layers launch one kernel per element-wise operation (RMSNorm's fp32 round
trip, rotary, residual adds, activations); inductor fuses those chains. What is compiled is the eager path's own call,
``functional_call(layer, weights, (carry,))``, one copy of that function per layer class. Dynamo
keeps its compiled graphs on a function's code object, guarded on the module's structure and the inputs' shapes and dtypes (parameters are graph
inputs, not constants), so the graph compiled for the first decoder layer serves every other layer
of that class and shape, in every stage, on every worker, for the rest of the process: one compile
per (layer class, grad mode, autocast, shapes), with a forward and a backward graph each.

Exact within fp32 rounding of the eager path: inductor may sum in another order (a norm's mean),
nothing else changes. Random numbers: ``fallback_random`` makes inductor call the eager random
ops on the same generator, so dropout draws what the eager layer draws, and the engine's per-layer
seeds replay it in recompute exactly as for eager layers. Shapes follow torch's automatic dynamic
shapes (``dynamic=None``): the first shape compiles static, a second one (another padded length,
a shorter last microbatch) compiles once more with those dimensions dynamic, which then serves
every later shape, so dynamic padding does not compile every step (dynamo's recompile limit bounds
the rest; past it the layer runs eagerly, still exact).

A layer class may keep its eager forward by setting ``compiled_on_workers = False`` (the causal
LM's prefix builds masks in Python, data-dependent; its postfix's chunked loss is a loop of
custom autograd Functions): those stay eager and exact.
"""

from __future__ import annotations

import threading
import time
import types
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call
from torch.utils import _pytree as pytree

# Inductor options: random ops run eagerly on the layer's generator (the RNG replay stays exact).
INDUCTOR_OPTIONS = {"fallback_random": True}


def _layer_call(layer: nn.Module, params: dict, carry: Any) -> Any:
    return functional_call(layer, params, (carry,))


def _call_for(cls: type) -> Callable:
    """A copy of ``_layer_call`` with a code object of its own: dynamo's graphs and its recompile limit
    are per code object, so each layer class gets its own (named after it in dynamo's logs)."""
    code = _layer_call.__code__.replace(co_name=f"compiled_{cls.__name__}")
    return types.FunctionType(code, _layer_call.__globals__, code.co_name)


class CompiledLayers:
    """The compiled forward of each layer class, shared by every engine of the process, and the time
    the calls that compiled took (``compile_seconds``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._forwards: dict[type, Callable] = {}
        self._seen: set[tuple] = set()
        self.compiles: list[tuple[str, float]] = []  # (what compiled, seconds of its first call)

    def _compiled_forward(self, cls: type) -> Callable:
        with self._lock:
            fn = self._forwards.get(cls)
            if fn is None:
                fn = torch.compile(_call_for(cls), dynamic=None, options=dict(INDUCTOR_OPTIONS))
                self._forwards[cls] = fn
            return fn

    def call(self, layer: nn.Module, params: dict, carry: Any) -> Any:
        """``functional_call(layer, params, (carry,))``, compiled unless the layer's class opts out."""
        if not getattr(layer, "compiled_on_workers", True):
            return functional_call(layer, params, (carry,))
        forward = self._compiled_forward(type(layer))
        key = self._signature(layer, carry)
        first = key not in self._seen
        start = time.perf_counter()
        out = forward(layer, params, carry)
        if first:
            with self._lock:
                if key not in self._seen:
                    self._seen.add(key)
                    self.compiles.append((f"{type(layer).__name__} grad={key[1]}", time.perf_counter() - start))
        return out

    @staticmethod
    def _signature(layer: nn.Module, carry: Any) -> tuple:
        """What a new compile depends on besides the module's structure: grad mode, autocast, input shapes."""
        leaves = pytree.tree_leaves(carry)
        shapes = tuple((tuple(x.shape), x.dtype, x.requires_grad) for x in leaves if isinstance(x, torch.Tensor))
        return (type(layer), torch.is_grad_enabled(), tuple(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")), shapes)

    def compile_seconds(self) -> float:
        """Seconds spent in the calls that compiled (first calls of each signature: compile plus one run)."""
        with self._lock:
            return sum(s for _, s in self.compiles)


COMPILED_LAYERS = CompiledLayers()
"""The process's compiled layer forwards (dynamo's cache is process-wide too)."""
