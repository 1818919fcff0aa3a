"""One ``torch.compile`` callable per (layer class, device, grad mode, autocast), its graphs counted, its
recompile limit a failure instead of a silent eager run.

Dynamo keeps compiled graphs, and its recompile limit (``torch._dynamo.config.recompile_limit``), per code
object, and guards each graph on the inputs' device index. One code object shared by every device therefore
fills its cache on 8 GPUs with the forward alone, and past the limit dynamo runs the function eagerly without
a word. ``KeyedCompiles`` gives every key a copy of the function with a code object of its own (named after
the key in dynamo's logs), counts the graphs dynamo holds for it, and calls it with dynamo's
``fail_on_recompile_limit_hit`` set, so reaching the limit raises ``RecompileLimitError``. Compiles feed the
process's ``COMPILE_CLOCK``, so that no timeout counts them.
"""

from __future__ import annotations

import contextlib
import re
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ..errors import RecompileLimitError
from ..host.compile_clock import COMPILE_CLOCK


@dataclass(frozen=True)
class CompileKey:
    """What selects a compiled callable: the layer class, the device (``cuda:3``; index included, as in
    dynamo's guards), grad mode and the autocast in force (``(device type, dtype)`` pairs, empty if none)."""

    cls: type
    device: str
    grad: bool
    autocast: tuple = ()

    def name(self, prefix: str) -> str:
        """A valid code name: ``<prefix>_<class>_<device>_<grad|nograd>[_<autocast dtype>]``."""
        cast = "".join(f"_{kind}_{str(dtype).removeprefix('torch.')}" for kind, dtype in self.autocast)
        text = f"{prefix}_{self.cls.__name__}_{self.device}_{'grad' if self.grad else 'nograd'}{cast}"
        return re.sub(r"\W", "_", text)


def device_of(*trees: Any) -> str:
    """The device of the first tensor in ``trees`` (dicts, lists, tuples, tensors), as ``cuda:0`` / ``cpu``."""
    for tree in trees:
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                return str(leaf.device)
    return "cpu"


def autocast_in_force() -> tuple:
    """``(device type, dtype)`` of each autocast enabled on this thread, for ``CompileKey.autocast``."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def graphs_of(code: types.CodeType) -> int | None:
    """How many graphs (cache entries) dynamo holds for ``code``; None where this torch cannot say."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # dynamo's own debug reader
    except ImportError:
        return None
    return len(_debug_get_cache_entry_list(code))


class _StrictLimit:
    """``torch._dynamo.config.fail_on_recompile_limit_hit`` set while any of our compiled calls runs (a
    count, so concurrent workers do not unset it under each other), and restored after the last one. Dynamo's
    config is process-wide: a user's own compiled function reaching its limit in that window raises too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._saved = False

    @contextlib.contextmanager
    def __call__(self):
        from torch._dynamo import config

        # dynamo refuses both at once (the user asked errors to run eagerly); a torch without the flag: as it is
        if config.suppress_errors or not hasattr(config, "fail_on_recompile_limit_hit"):
            yield
            return
        with self._lock:
            if self._inside == 0:
                self._saved = config.fail_on_recompile_limit_hit
                config.fail_on_recompile_limit_hit = True
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0:
                    config.fail_on_recompile_limit_hit = self._saved


STRICT_LIMIT = _StrictLimit()


class KeyedCompiles:
    """``torch.compile`` of copies of ``fn``, one per ``CompileKey`` (``prefix`` names them)."""

    def __init__(self, fn: Callable, prefix: str, options: dict) -> None:
        self._fn, self._prefix, self._options = fn, prefix, options
        self._lock = threading.Lock()
        self._compiled: dict[CompileKey, tuple[Callable, types.CodeType]] = {}

    def callable_for(self, key: CompileKey) -> Callable:
        """The compiled callable of ``key`` (made on first use)."""
        with self._lock:
            hit = self._compiled.get(key)
            if hit is None:
                code = self._fn.__code__.replace(co_name=key.name(self._prefix))
                copy = types.FunctionType(code, self._fn.__globals__, code.co_name, self._fn.__defaults__,
                                          self._fn.__closure__)
                hit = (torch.compile(copy, dynamic=None, options=dict(self._options)), code)
                self._compiled[key] = hit
            return hit[0]

    def call(self, key: CompileKey, *args: Any) -> Any:
        """``fn(*args)`` compiled for ``key``; ``RecompileLimitError`` where its code object reached the limit."""
        from torch._dynamo import exc as dynamo_errors

        limit_hit = getattr(dynamo_errors, "FailOnRecompileLimitHit", ())  # () catches nothing where torch lacks it
        fn = self.callable_for(key)
        COMPILE_CLOCK.watch_dynamo()  # each call: torch._dynamo.reset() drops the clock's callbacks
        try:
            with STRICT_LIMIT():
                return fn(*args)
        except limit_hit as exc:
            from torch._dynamo import config

            raise RecompileLimitError(
                f"{key.name(self._prefix)} reached torch._dynamo's recompile limit "
                f"(torch._dynamo.config.recompile_limit = {getattr(config, 'recompile_limit', None)}, graphs held: "
                f"{self.graphs().get(key.name(self._prefix))}): this layer's inputs took more shapes or branches "
                f"(mask variants) on {key.device} than the limit holds, and its next call would have run eagerly "
                "behind compiled ones. Raise torch._dynamo.config.recompile_limit before fit (each device, grad "
                "mode and autocast has a limit of its own), or set compile_layers=False to run the layers eagerly. "
                "The failed step changed no weight.") from exc

    def graphs(self) -> dict[str, int]:
        """Graphs dynamo holds per compiled callable, by code name (those it cannot count are left out)."""
        with self._lock:
            codes = [(key.name(self._prefix), code) for key, (_, code) in self._compiled.items()]
        counts = {name: graphs_of(code) for name, code in codes}
        return {name: n for name, n in counts.items() if n is not None}
