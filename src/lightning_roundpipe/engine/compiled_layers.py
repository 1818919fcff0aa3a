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

A compiler's failure (an exception of ``torch._dynamo`` or ``torch._inductor``, in a forward or in
the backward graph's first run) fails the task with ``LayerCompileError``, which says how to run
the layers eagerly; like any failed step, it leaves the weights and the optimizer state as they
were. Nothing falls back to eager by itself: a layer whose forward ran compiled and whose recompute
then ran eagerly would mix two roundings in one step, and the user should know their GPU run is
eager.

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

from ..workers.completions import raised_from

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


COMPILER_MODULES = ("torch._dynamo", "torch._inductor")  # where a compiler's own exceptions live


class LayerCompileError(RuntimeError):
    """``torch.compile`` failed on a worker's layers (``compile_layers``); the message says how to run
    them eagerly. ``__cause__`` is the compiler's exception."""


def is_compile_failure(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, is one of the compiler's own."""
    return any(type(e).__module__.startswith(COMPILER_MODULES) for e in raised_from(exc))


def naming_compile_failures(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` (a compute task's work), with a compiler's failure inside it raised as ``LayerCompileError``."""

    def run():
        try:
            return fn()
        except Exception as exc:
            if not is_compile_failure(exc):
                raise
            root = exc  # the compiler's wrappers keep what raised inside as inner_exception or __cause__
            for _ in range(10):
                inner = getattr(root, "inner_exception", None) or root.__cause__
                if inner is None or inner is root:
                    break
                root = inner
            first = (str(root).strip().splitlines() or [""])[0][:300]
            raise LayerCompileError(
                f"torch.compile failed on this worker's layers ({type(exc).__name__}, from "
                f"{type(root).__name__}: {first}). The layers "
                "compile because compile_layers is True, or None on a GPU with Triton; set compile_layers=False "
                "(RoundPipeStrategy(compile_layers=False), or strategy.compile_layers=false in the Hydra config) "
                "to run them eagerly. With compiled layers the early-stopping recompute compiles one more graph per "
                "layer class, a layer's forward and backward together (recompute_early_stop, None by default: on "
                "with compiled layers); recompute_early_stop=False leaves that graph out and keeps the layers "
                "compiled. The failed step changed no weight.") from exc

    return run


COMPILED_LAYERS = CompiledLayers()
"""The process's compiled layer forwards (dynamo's cache is process-wide too)."""
