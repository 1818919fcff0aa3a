"""Pinning host memory in place (``cudaHostRegister``), with its errors checked and cleared.

CUDA pins whole pages (a second registration of a page fails, error 712) and a failed call leaves
an error that the next kernel launch check would report as its own. So a tensor is registered
as its run of pages minus those already registered, every failed call is cleared with
``cudaGetLastError`` and the tensor stays pageable with its reason counted in
``pageable_reasons``, and a run is unregistered with the last tensor that relied on it.
``cudart`` is ``torch_cudart`` on a GPU or the lab's ``FakeCudart`` on the fake streams. Details:
docs/design.md, design notes, ``workers/pinning.py``.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import mmap
import threading

import torch

PAGE = mmap.PAGESIZE
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def page_span(ptr: int, nbytes: int) -> tuple[int, int]:
    """The page-aligned [start, end) that holds ``nbytes`` bytes at ``ptr``."""
    return ptr - ptr % PAGE, -(-(ptr + nbytes) // PAGE) * PAGE


class PinRegistry:
    """What this process pinned in place: page runs, which tensors rely on them, and why others stay pageable."""

    def __init__(self, cudart) -> None:
        self.cudart = cudart
        self._starts: list[int] = []  # sorted starts of registered runs
        self._runs: dict[int, list] = {}  # start -> [end, set of tensor keys relying on it]
        self._users: dict[tuple[int, int], list[int]] = {}  # (data_ptr, nbytes) -> starts of its runs
        self.pageable_reasons: collections.Counter = collections.Counter()
        self.register_calls = 0
        self.pinned_elsewhere = 0  # tensors found pinned by someone else (torch's host allocator)
        self._lock = threading.Lock()

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t.numel() * t.element_size()

    def _overlapping(self, lo: int, hi: int) -> list[int]:
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        out = []
        while i < len(self._starts) and self._starts[i] < hi:
            s = self._starts[i]
            if self._runs[s][0] > lo:
                out.append(s)
            i += 1
        return out

    def _gaps(self, lo: int, hi: int) -> list[tuple[int, int]]:
        gaps, at = [], lo
        for s in self._overlapping(lo, hi):
            if s > at:
                gaps.append((at, s))
            at = max(at, self._runs[s][0])
        if at < hi:
            gaps.append((at, hi))
        return gaps

    def covers(self, t: torch.Tensor) -> bool:
        """Whether all of ``t``'s memory lies in registered (pinned) pages."""
        if self._key(t) in self._users:
            return True
        if t.device.type != "cpu" or t.numel() == 0:
            return False
        with self._lock:
            return not self._gaps(*page_span(t.data_ptr(), t.numel() * t.element_size()))

    def holds(self, ptr: int) -> bool:
        """Whether ``ptr`` lies in a run of pages this registry registered."""
        with self._lock:
            return bool(self._overlapping(ptr, ptr + 1))

    def _clear_error(self) -> None:
        self.cudart.cudaGetLastError()  # the failed call's error must not surface at a later launch

    def register(self, t: torch.Tensor) -> bool:
        """Pin ``t`` in place; False (with a counted reason) when it stays pageable."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            self.pageable_reasons["not a contiguous, non-empty host tensor"] += 1
            return False
        key = self._key(t)
        with self._lock:
            if key in self._users:
                return True  # already pinned by this registry: never registered twice
            lo, hi = page_span(*key)
            made = []
            for a, b in self._gaps(lo, hi):
                self.register_calls += 1
                err = int(self.cudart.cudaHostRegister(a, b - a, 0))
                if err != 0:
                    self._clear_error()
                    self.pageable_reasons[f"cudaHostRegister failed with CUDA error {err}"] += 1
                    for s in made:  # all of the tensor pinned or none of it
                        self._drop_run(s)
                    return False
                bisect.insort(self._starts, a)
                self._runs[a] = [b, set()]
                made.append(a)
            starts = self._overlapping(lo, hi)
            for s in starts:
                self._runs[s][1].add(key)
            self._users[key] = starts
            return True

    def _drop_run(self, start: int) -> None:
        self._runs.pop(start)
        self._starts.remove(start)
        if int(self.cudart.cudaHostUnregister(start)) != 0:
            self._clear_error()
            self.pageable_reasons["cudaHostUnregister failed"] += 1

    def unregister(self, t: torch.Tensor) -> None:
        """Drop ``t``'s registration; its pages are unpinned once no other tensor uses them."""
        key = self._key(t)
        with self._lock:
            for s in self._users.pop(key, ()):
                run = self._runs.get(s)
                if run is None:
                    continue
                run[1].discard(key)
                if not run[1]:
                    self._drop_run(s)

    @property
    def registered_runs(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each registered run of pages."""
        with self._lock:
            return [(s, self._runs[s][0]) for s in self._starts]


def page_runs(pages: dict[int, int]):
    """The page-aligned span of each registered run."""
    for s, e in list(pages.items()):
        yield page_span(s, e - s)


class _TorchCudart:
    """torch's ``cudaHostRegister`` binding plus ``cudaGetLastError``, which torch does not bind:
    called through ctypes on the libcudart this process already loaded (the same runtime, so the
    same per-thread error)."""

    def __init__(self) -> None:
        self._rt = torch.cuda.cudart()
        self._get_last = None
        for path in _loaded_libcudart():
            try:
                self._get_last = ctypes.CDLL(path).cudaGetLastError
                break
            except (OSError, AttributeError):
                continue

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        return int(self._rt.cudaHostRegister(ptr, nbytes, flags))

    def cudaHostUnregister(self, ptr: int) -> int:
        return int(self._rt.cudaHostUnregister(ptr))

    def cudaGetLastError(self) -> int:
        return int(self._get_last()) if self._get_last is not None else 0


def _loaded_libcudart() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        paths = set()
    return sorted(paths) + ["libcudart.so", "libcudart.so.12"]


_shared: PinRegistry | None = None
_shared_lock = threading.Lock()


def cuda_pin_registry() -> PinRegistry:
    """The process's one registry for real CUDA (every pool and the shadows share it, so that no
    page is registered twice whoever asks)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = PinRegistry(_TorchCudart())
        return _shared
