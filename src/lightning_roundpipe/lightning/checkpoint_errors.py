"""What goes wrong with checkpoint files, said in words: an unreadable file, a full disk.

torch reports a truncated or empty file as ``EOFError`` or ``OSError: Invalid argument`` and a
full disk mid-save as ``unexpected pos``; these helpers turn them into errors that name the
file, the cause and what to do, and check the free space before a save writes anything.
"""

from __future__ import annotations

import errno
import os
import shutil
import zipfile

import torch
import torch.utils._pytree as pytree

from ..errors import CheckpointError, CheckpointSpaceError
from ..workers.task_errors import raised_from

FULL_DISK_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def unreadable(path, err: BaseException) -> CheckpointError | None:
    """The error for a local checkpoint file ``torch.load`` failed on because the file is empty or
    not a whole archive; None when the file is whole (``err`` then says what is wrong)."""
    size = os.path.getsize(path)
    if size == 0:
        cause = "is empty (0 bytes)"
    elif not zipfile.is_zipfile(path) and "Weights only load failed" not in str(err):
        cause = (f"is truncated or not a PyTorch checkpoint ({size} bytes, not the whole zip archive torch.save "
                 "writes)")
    else:
        return None
    return CheckpointError(
        f"checkpoint {os.fspath(path)} {cause}. It was probably cut short (a copy or save that did not finish): "
        "resume from another checkpoint, or copy this one again. Nothing was loaded.")


def _stored_bytes(checkpoint) -> int:
    """Bytes of the tensor storages in ``checkpoint`` (each shared storage once): what torch.save writes, about."""
    seen, total = set(), 0
    for leaf in pytree.tree_leaves(checkpoint):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            storage = leaf.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def previous_file(path: str) -> str:
    """What became of the destination: the previous checkpoint intact, or no file written."""
    return (f"the previous checkpoint {path} is intact" if os.path.exists(path)
            else f"no file was written at {path}")


def check_space(checkpoint, path: str, directory: str) -> None:
    """Refuse a save whose tensors alone do not fit in the free space of ``directory``, before writing."""
    needed = _stored_bytes(checkpoint)
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise CheckpointSpaceError(
            f"no space left for the checkpoint {path}: it needs at least {needed} bytes and {directory} has {free} "
            f"free; free some space or save elsewhere (ModelCheckpoint(dirpath=...)). Nothing was written: "
            f"{previous_file(path)}.")


def is_full_disk(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) is the disk running full."""
    return any(isinstance(e, OSError) and e.errno in FULL_DISK_ERRNOS for e in raised_from(err))


def disk_filled(path: str, directory: str) -> CheckpointSpaceError:
    """The error of a save that filled the disk, naming the file, the folder and what to do."""
    return CheckpointSpaceError(
        f"no space left on the device while saving the checkpoint {path}: free some space in {directory} or save "
        f"elsewhere (ModelCheckpoint(dirpath=...)). The partial file was removed and {previous_file(path)}.")
