"""Writing the kept steps' timeline to disk: the folder checked at set-up, the files written at the end."""

from __future__ import annotations

import logging
import os
import tempfile

from ..errors import OptionError

log = logging.getLogger("lightning_roundpipe")


def check_writable_dir(directory, option: str) -> str:
    """Create ``directory`` if needed and prove it writable now, before any training starts."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise OptionError(f"{option}={os.fspath(directory)!r}: cannot write there ({err}); pass a writable folder") from err
    return os.fspath(directory)


def export_timeline(records, directory) -> list[str]:
    """Write ``records`` as a Chrome/Perfetto trace and, with matplotlib, a PNG Gantt chart; the paths written."""
    from .timeline import save_gantt_png, to_chrome_trace

    if not records:
        return []
    os.makedirs(directory, exist_ok=True)
    written = [os.path.join(directory, "roundpipe_trace.json")]
    to_chrome_trace(records, written[0])
    try:
        save_gantt_png(records, os.path.join(directory, "roundpipe_timeline.png"), title="RoundPipe timeline")
        written.append(os.path.join(directory, "roundpipe_timeline.png"))
    except ImportError as err:
        log.warning("timeline PNG not written: %s", err)
    return written
