"""Checkpoints written atomically: a crash mid-write leaves the previous file intact.

The file is written under a temporary name, flushed and renamed over the destination
(``os.replace``), in Lightning's own format (plain ``torch.load`` reads it). An unreadable file,
a disk that fills up, or a save that cannot fit the free space fail with ``CheckpointError``
naming the file, the cause and what to do. Leftover temporary files of killed saves are removed
by the next save, except those another writer holds (``flock``). Details: docs/design.md, design
notes, ``lightning/checkpoint_io.py``.
"""

from __future__ import annotations

import glob
import os
import pickle
import tempfile
import time

from typing import Callable

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ..setup_progress import FileProgress, ProgressCallback
from .checkpoint_errors import check_space, disk_filled, is_full_disk, unreadable
from .checkpoint_integrity import verify_archive

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; leftovers are told apart by age
    fcntl = None

LOAD_PHASE = "RoundPipe: loading checkpoint"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic saves and load progress.

    Args:
        progress: called at each load for the ``progress(phase, done, total)`` callback to use
            (``None``: none), so that only rank zero draws.
        verify: check every entry of a local checkpoint against its CRC-32 before loading it
            (``checkpoint_integrity.verify_archive``; the strategy's ``verify_checkpoints``).
    """

    def __init__(self, progress: Callable[[], ProgressCallback | None] | None = None, verify: bool = False):
        super().__init__()
        self.progress = progress
        self.verify = verify

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only=None) -> dict:
        progress = self.progress() if self.progress is not None else None
        local = os.path.isfile(os.fspath(path))
        if self.verify and local:
            verify_archive(path)  # before anything is read into the model
        try:
            if progress is None or not local:
                return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            with open(path, "rb") as f:  # what Lightning's loader does for a local file, with reads counted
                size = os.fstat(f.fileno()).st_size
                loaded = torch.load(FileProgress(f, size, LOAD_PHASE, progress), map_location=map_location,
                                    weights_only=weights_only)
        except (EOFError, OSError, RuntimeError, pickle.UnpicklingError) as err:
            cut_short = unreadable(path, err) if local and not isinstance(err, FileNotFoundError) else None
            if cut_short is not None:
                raise cut_short from err
            raise
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
        check_space(checkpoint, path, directory)
        remove_interrupted_saves(directory)
        fd, tmp, locked = _owned_temporary(directory, os.path.basename(path))
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
                if locked:  # renamed while the lock is held, so no other save's clean-up can take it
                    os.replace(tmp, path)
            if not locked:
                os.replace(tmp, path)
        except BaseException as err:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            if is_full_disk(err):  # torch says "unexpected pos"; the OSError it hides says why
                raise disk_filled(path, directory) from err
            raise


TEMPORARY_PATTERN = ".tmp-*.ckpt-*"
UNLOCKED_LEFTOVER_AGE_S = 24 * 3600  # without locks: a file this old has no writer left


def _try_lock(fd: int) -> bool | None:
    """Take an exclusive lock on ``fd`` without waiting: True when taken, False when another
    process holds it, None when this platform or filesystem has no locks."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP: a filesystem without locks
        return None


def _owned_temporary(directory: str, name: str) -> tuple[int, str, bool]:
    """A new temporary file for ``name`` in ``directory``: (fd, path, whether it is locked)."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-" + name + "-", dir=directory)
        locked = _try_lock(fd) is True
        if not locked:
            return fd, tmp, False
        try:  # another save's clean-up may have taken the file between its creation and the lock
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, tmp, True
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_interrupted_saves(directory: str) -> list[str]:
    """Delete the temporary files interrupted saves left in ``directory`` (none a live writer
    holds, see the module doc); return their paths."""
    removed = []
    for leftover in glob.glob(os.path.join(glob.escape(directory), TEMPORARY_PATTERN)):
        try:
            fd = os.open(leftover, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            free = _try_lock(fd)
            if free is None:
                free = time.time() - os.fstat(fd).st_mtime > UNLOCKED_LEFTOVER_AGE_S
            if free:
                os.unlink(leftover)
                removed.append(leftover)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed
