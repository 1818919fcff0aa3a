"""The process's older objects kept out of Python's full garbage collections while a runtime is attached
(``gc_freeze=True``, the default).

A training process tracks hundreds of thousands of objects that torch, Lightning and transformers
created at import and set-up (423k in the test process). Python runs a full collection once the
objects promoted to its oldest generation reach a quarter of those there. Every step promotes the
objects it keeps until its end: its tasks, their completions and closures. So full collections
come every few steps, and each traverses all of them while it holds the interpreter lock: every
lane stops. Measured (``docs/measurements.md`` section 11): 16 one-layer stages on the CPU backend,
a full collection every 15 steps, 210 ms each, 14 ms per step on average.

``gc.freeze()`` moves every tracked object to the permanent generation, which collections skip;
``gc.unfreeze()`` puts them back into the oldest one. The first runtime to attach freezes; each
later one freezes again (its own set-up's objects too); the last to detach unfreezes, so that
objects which became garbage meanwhile are collected again. Cyclic garbage that exists at an
attach is kept until the last runtime detaches. If something else had frozen objects before the
first attach (``gc.get_freeze_count() > 0``), the runtimes leave the collector alone: unfreezing
would undo that. Neither call touches a tensor or any result.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0
_ours = False  # whether the holders froze (nothing was frozen before the first of them)


class OlderObjectsFrozen:
    """One runtime's hold on the frozen generation: ``release`` (idempotent) ends it."""

    def __init__(self) -> None:
        global _holders, _ours
        with _lock:
            if _holders == 0:
                _ours = gc.get_freeze_count() == 0
            if _ours:
                gc.freeze()
            _holders += 1
        self._held = True

    def release(self) -> None:
        """End this hold; the last one unfreezes what the holders froze."""
        global _holders, _ours
        with _lock:
            if not self._held:
                return
            self._held = False
            _holders -= 1
            if _holders == 0 and _ours:
                gc.unfreeze()
                _ours = False


def holders() -> int:
    """How many runtimes hold the frozen generation now."""
    return _holders
