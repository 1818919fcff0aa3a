"""Checkpoint integrity: every entry of a checkpoint archive checked against its CRC-32 before it loads.

``torch.save`` writes a zip archive whose entries (the pickled dict, one per tensor storage) each
carry a CRC-32, but ``torch.load`` never checks them: a flipped bit in a weight loads silently,
under every strategy. ``verify_archive`` recomputes each entry's CRC-32 (zlib, which releases the
GIL, over a read-only memory map; large entries in a few threads) and raises
``CheckpointIntegrityError`` naming the file and entry. Nothing is added to the file, so
checkpoints written by any strategy or torch version can be checked. Files in torch's legacy
(non-zip) format carry no checksums and load unchecked. Cost: ``benchmarks/calibration/checkpoint_integrity.py``.
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointIntegrityError
from .checkpoint_errors import CheckpointError

LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
LOCAL_SIGNATURE = b"PK\x03\x04"
PARALLEL_BYTES = 1 << 20  # entries at least this large are checked in threads (zlib releases the GIL)


def _stored_bytes(view: memoryview, info: zipfile.ZipInfo, path: str) -> memoryview:
    """The bytes of an uncompressed entry, located through its local header."""
    start = info.header_offset
    signature, name_len, extra_len = LOCAL_HEADER.unpack_from(view, start)
    if signature != LOCAL_SIGNATURE:
        raise CheckpointIntegrityError(f"checkpoint {path} is damaged: the header of its entry {info.filename!r} "
                                       f"is not where the archive's directory says. {_advice()}")
    begin = start + LOCAL_HEADER.size + name_len + extra_len
    return view[begin:begin + info.compress_size]


def _advice() -> str:
    return ("Load an earlier checkpoint or copy the file again; RoundPipeStrategy(verify_checkpoints=False) "
            "loads it without this check")


def _check(view: memoryview, info: zipfile.ZipInfo, path: str, archive: zipfile.ZipFile) -> None:
    if info.compress_type == zipfile.ZIP_STORED:
        data = _stored_bytes(view, info, path)
        crc = zlib.crc32(data)
        size = len(data)
        del data
    else:  # torch stores entries uncompressed; others are read through zipfile, which checks them itself
        crc, size = info.CRC, info.file_size
        try:
            with archive.open(info) as f:
                while f.read(1 << 20):
                    pass
        except zipfile.BadZipFile:
            crc = -1
    if crc != info.CRC:
        raise CheckpointIntegrityError(
            f"checkpoint {path} is corrupt: its entry {info.filename!r} ({size} bytes) fails its CRC-32 check "
            f"(stored {info.CRC:08x}, computed {crc & 0xFFFFFFFF:08x}), so some of its bytes changed after it was "
            f"written (disk, copy or transfer). {_advice()}.")


def verify_archive(path, threads: int | None = None) -> int:
    """Check every entry of the checkpoint at ``path`` against its stored CRC-32; return how many were
    checked (0 for a legacy, non-zip file, which has none). ``threads``: for entries of at least
    ``PARALLEL_BYTES`` (None: up to 8, one per usable core)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        if not zipfile.is_zipfile(f):
            return 0
        f.seek(0)
        try:
            archive = zipfile.ZipFile(f)
        except zipfile.BadZipFile as err:
            raise CheckpointIntegrityError(f"checkpoint {path} is damaged: its archive directory cannot be read "
                                           f"({err}). {_advice()}.") from err
        infos = archive.infolist()
        if not infos or os.fstat(f.fileno()).st_size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                large = [i for i in infos if i.compress_size >= PARALLEL_BYTES]
                for info in infos:
                    if info.compress_size < PARALLEL_BYTES:
                        _check(view, info, path, archive)
                if large:
                    workers = threads or max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                    else (os.cpu_count() or 1)))
                    with ThreadPoolExecutor(min(workers, len(large))) as pool:
                        for done in [pool.submit(_check, view, info, path, archive) for info in large]:
                            done.result()
            finally:
                view.release()
    return len(infos)
