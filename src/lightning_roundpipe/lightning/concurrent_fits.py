"""Several fits in one process, on several threads: their data loading takes torch's CPU generator alone.

A DataLoader draws from torch's default CPU generator when an epoch's iterator starts (its base
seed) and, shuffled, when its sampler starts. Under RoundPipe on the CPU backend, that
generator is guarded while pipelined layers run (``engine/rng.py``: a change during a layer known
not to draw is refused as ``UnseededDraw``). One fit's loops fetch data between its own pipelined
calls, but another fit's loops do not know about them (issue 43, item 9). So while more than one
RoundPipe fit is live, ``gate_data_draws`` makes each DataLoader start its iterators and fetch its
batches holding the generator gate exclusively, as a seeded layer does: no draw lands inside
another fit's layer, and each fit computes what it computes alone. With one fit live, nothing waits.
"""

from __future__ import annotations

import contextlib
import threading

from torch.utils.data import DataLoader

from ..runtime import holding_cpu_generator
from ..user_patches import set_class

_lock = threading.Lock()
_live = 0


class LiveFit:
    """One fit's place among the process's live fits; ``leave`` (idempotent) ends it."""

    def __init__(self) -> None:
        global _live
        with _lock:
            _live += 1
        self._live = True

    def leave(self) -> None:
        """This fit is over."""
        global _live
        with _lock:
            if self._live:
                self._live = False
                _live -= 1


def live_fits() -> int:
    """How many RoundPipe fits run in this process now."""
    return _live


def _data_draws_held():
    if _live < 2:
        return contextlib.nullcontext()
    return holding_cpu_generator(f"data loading on thread {threading.current_thread().name}")


class _HeldIterator:
    """A DataLoader iterator whose batches are fetched under ``_data_draws_held``."""

    def __init__(self, iterator) -> None:
        self._iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        with _data_draws_held():
            return next(self._iterator)

    def __len__(self) -> int:
        return len(self._iterator)

    def __getattr__(self, name):  # what Lightning or the user reads of the iterator itself
        return getattr(self._iterator, name)


_gated_classes: dict[type, type] = {}


def _gated_class(cls: type) -> type:
    gated = _gated_classes.get(cls)
    if gated is None:
        def __iter__(self):
            with _data_draws_held():
                return _HeldIterator(cls.__iter__(self))

        gated = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                            "__doc__": cls.__doc__, "_roundpipe_gated": True})
        _gated_classes[cls] = gated
    return gated


def gate_data_draws(dataloader):
    """``dataloader`` (a DataLoader; anything else is returned as it is), made to start iterators and
    fetch batches holding torch's CPU generator alone while another RoundPipe fit is live. It stays
    an instance of its own class (a subclass of it with the same name) until ``ungate``."""
    if isinstance(dataloader, DataLoader) and not getattr(dataloader, "_roundpipe_gated", False):
        set_class(dataloader, _gated_class(type(dataloader)))
    return dataloader


def ungate(dataloader) -> None:
    """Give a DataLoader ``gate_data_draws`` changed its own class back (the fit that served it is over)."""
    cls = type(dataloader)
    if cls in _gated_classes.values():
        set_class(dataloader, cls.__mro__[1])
