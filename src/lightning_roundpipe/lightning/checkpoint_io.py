"""Checkpoints written atomically: a crash mid-write leaves the previous file intact.

The file is written next to its destination under a temporary name, flushed to disk, and
renamed over the destination (``os.replace`` is atomic on POSIX and Windows). The format is
Lightning's own (``torch.save`` of the checkpoint dict), so it loads with plain ``torch.load``
and into a model trained under any strategy. Loading a local file reports its bytes read to
``progress`` (a set-up progress bar, shown for large files only). A save interrupted hard enough to skip its own
clean-up (a killed process, a power cut) leaves a ``.tmp-<name>-<random>`` file; the next save
into that folder removes every such file before it writes.
"""

from __future__ import annotations

import glob
import os
import tempfile

from typing import Callable

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ..setup_progress import FileProgress, ProgressCallback

LOAD_PHASE = "RoundPipe: loading checkpoint"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic saves and load progress.

    Args:
        progress: called at each load for the ``progress(phase, done, total)`` callback to use
            (``None``: none), so that only rank zero draws.
    """

    def __init__(self, progress: Callable[[], ProgressCallback | None] | None = None):
        super().__init__()
        self.progress = progress

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only=None) -> dict:
        progress = self.progress() if self.progress is not None else None
        if progress is None or not os.path.isfile(os.fspath(path)):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        with open(path, "rb") as f:  # what Lightning's loader does for a local file, with reads counted
            size = os.fstat(f.fileno()).st_size
            loaded = torch.load(FileProgress(f, size, LOAD_PHASE, progress), map_location=map_location,
                                weights_only=weights_only)
        progress(LOAD_PHASE, size, size)
        return loaded

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options}")
        path = os.fspath(path)
        fs = get_filesystem(path)
        if fs.protocol not in ("file", ("file", "local")) and "file" not in getattr(fs, "protocol", ()):
            return super().save_checkpoint(checkpoint, path)  # remote filesystems: their own semantics
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        remove_interrupted_saves(directory)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + "-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise


TEMPORARY_PATTERN = ".tmp-*.ckpt-*"


def remove_interrupted_saves(directory: str) -> list[str]:
    """Delete the temporary files earlier interrupted saves left in ``directory``; return their paths."""
    removed = []
    for leftover in glob.glob(os.path.join(glob.escape(directory), TEMPORARY_PATTERN)):
        try:
            os.unlink(leftover)
            removed.append(leftover)
        except FileNotFoundError:
            pass
    return removed
