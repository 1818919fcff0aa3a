"""Layers run through ``torch.compile`` on the workers (``compile_layers``: True, or None on GPUs).

Eager layers launch one kernel per element-wise operation; inductor fuses those chains. The
eager path's own call, ``functional_call(layer, weights, (carry,))``, is compiled once per
(layer class, device, grad mode, autocast) (``CompileKey``), so one graph serves every layer of
that class and shape. Exact within fp32 rounding; dropout replays under ``fallback_random``.
Graphs are counted, and reaching dynamo's recompile limit (``RecompileLimitError``) or any
compiler failure (``LayerCompileError``) fails the step instead of running eagerly. Why:
docs/design.md, design notes, ``engine/compiled_layers.py``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call
from torch.utils import _pytree as pytree

from ..errors import LayerCompileError
from ..workers.task_errors import raised_from
from .compile_keys import CompileKey, KeyedCompiles, RecompileLimitError, autocast_in_force, device_of

# Inductor options: random ops run eagerly on the layer's generator (the RNG replay stays exact).
INDUCTOR_OPTIONS = {"fallback_random": True}


def _layer_call(layer: nn.Module, params: dict, carry: Any) -> Any:
    return functional_call(layer, params, (carry,))


class CompiledLayers:
    """The compiled forward of each (layer class, device, grad mode, autocast), shared by every engine of the
    process; the time the calls that compiled took (``compile_seconds``) and the graphs dynamo holds
    (``graphs``, ``recompiles``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._forwards = KeyedCompiles(_layer_call, "compiled", INDUCTOR_OPTIONS)
        self._seen: set[tuple] = set()
        self.compiles: list[tuple[str, float]] = []  # (what compiled, seconds of its first call)

    def call(self, layer: nn.Module, params: dict, carry: Any, device: str | None = None) -> Any:
        """``functional_call(layer, params, (carry,))``, compiled unless the layer's class opts out. ``device``:
        the device the call's graph is kept for (default: the first tensor's, as dynamo guards it)."""
        if not getattr(layer, "compiled_on_workers", True):
            return functional_call(layer, params, (carry,))
        key = CompileKey(type(layer), device or device_of(carry, params), torch.is_grad_enabled(), autocast_in_force())
        signature = (key, self._shapes(carry))
        first = signature not in self._seen
        start = time.perf_counter()
        out = self._forwards.call(key, layer, params, carry)
        if first:
            with self._lock:
                if signature not in self._seen:
                    self._seen.add(signature)
                    self.compiles.append((f"{key.cls.__name__} grad={key.grad} on {key.device}",
                                          time.perf_counter() - start))
        return out

    @staticmethod
    def _shapes(carry: Any) -> tuple:
        """What a new compile depends on besides the key and the module's structure: the inputs' shapes."""
        leaves = pytree.tree_leaves(carry)
        return tuple((tuple(x.shape), x.dtype, x.requires_grad) for x in leaves if isinstance(x, torch.Tensor))

    def compile_seconds(self) -> float:
        """Seconds spent in the calls that compiled (first calls of each signature: compile plus one run)."""
        with self._lock:
            return sum(s for _, s in self.compiles)

    def graphs(self) -> dict[str, int]:
        """Graphs dynamo holds per compiled forward (``compiled_<class>_<device>_<grad mode>``)."""
        return self._forwards.graphs()

    def recompiles(self) -> int:
        """Graphs beyond the first of each compiled forward: new shapes or branches of one key."""
        return sum(max(0, n - 1) for n in self.graphs().values())


COMPILER_MODULES = ("torch._dynamo", "torch._inductor")  # where a compiler's own exceptions live


def is_compile_failure(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, is one of the compiler's own."""
    return any(type(e).__module__.startswith(COMPILER_MODULES) for e in raised_from(exc))


def naming_compile_failures(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` (a compute task's work), with a compiler's failure inside it raised as ``LayerCompileError``."""

    def run():
        try:
            return fn()
        except Exception as exc:
            if isinstance(exc, (LayerCompileError, RecompileLimitError)) or not is_compile_failure(exc):
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
