"""The process's older objects kept out of Python's full garbage collections while a runtime is attached
(``gc_freeze=True``, the default).

Every step promotes the objects it keeps to Python's oldest generation, so full collections
come every few steps and each traverses the hundreds of thousands of objects torch, Lightning
and transformers made at set-up, holding the interpreter lock while every lane stops.
``gc.freeze()`` at attach takes those objects out of collections; the last runtime to detach
unfreezes. Measurements and the rules: docs/design.md, design notes, ``host/host_gc.py``.
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
