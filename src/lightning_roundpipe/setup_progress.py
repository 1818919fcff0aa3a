"""Progress of long set-up work (estimating layer costs, the ``auto`` plan search, loading a checkpoint).

The planning and cost code take an optional ``progress`` callback, ``progress(phase, done, total)``,
and stay free of any display. ``RichSetupProgress`` is the display: a ``rich.progress`` bar in
the style of Lightning's ``RichProgressBar``. It draws nothing when the console is not a terminal
(a job writing to a log file keeps clean output) and nothing for a phase that ends within
``delay_s`` (the usual case on small models), so only set-up the user would wait for is shown.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

ProgressCallback = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: ``done`` of ``total`` units of ``phase`` are finished."""

DEFAULT_DELAY_S = 1.0  # a phase shorter than this draws nothing


def report(progress: Optional[ProgressCallback], phase: str, done: int, total: int) -> None:
    """Call ``progress`` if there is one (the planning code's only use of it)."""
    if progress is not None:
        progress(phase, done, total)


class FileProgress:
    """A binary file whose reads report ``(phase, bytes read so far, file size)``; for ``torch.load``.

    Bytes read, not the position: a zip reader seeks to the directory at the end first. Until the
    caller reports the end, ``done`` stays below the size (small re-reads may count twice)."""

    def __init__(self, file, size: int, phase: str, progress: ProgressCallback):
        self.file, self.size, self.phase, self.progress = file, size, phase, progress
        self.bytes_read = 0

    def _count(self, n: int) -> None:
        self.bytes_read += n
        self.progress(self.phase, min(self.bytes_read, max(self.size - 1, 0)), self.size)

    def read(self, n: int = -1) -> bytes:
        """Read like the wrapped file and count the bytes."""
        data = self.file.read(n)
        self._count(len(data))
        return data

    def readinto(self, buffer) -> int:
        """Read into ``buffer`` like the wrapped file and count the bytes."""
        count = self.file.readinto(buffer)
        self._count(count or 0)
        return count

    def seek(self, offset: int, whence: int = 0) -> int:
        """Seek in the wrapped file."""
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        """The wrapped file's position."""
        return self.file.tell()

    def readline(self, size: int = -1) -> bytes:
        """Read a line from the wrapped file."""
        return self.file.readline(size)

    def seekable(self) -> bool:
        """Always True: checkpoint files are seekable."""
        return True

    def readable(self) -> bool:
        """Always True."""
        return True


class RichSetupProgress:
    """A ``ProgressCallback`` drawing one ``rich`` progress bar per phase, on a terminal only.

    Args:
        delay_s: a phase is drawn only once it has run this long and is not finished yet.
        console: the ``rich.console.Console`` to draw on (default: a new one on stdout).
        clock: seconds, monotonic (for tests).
    """

    def __init__(self, delay_s: float = DEFAULT_DELAY_S, console=None, clock: Callable[[], float] = time.monotonic):
        from rich.console import Console

        self.delay_s = delay_s
        self.console = console if console is not None else Console()
        self.clock = clock
        self.started: dict[str, float] = {}
        self.bar = None
        self.tasks: dict[str, int] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = self.clock()
        start = self.started.setdefault(phase, now)
        finished = done >= total
        if phase not in self.tasks:
            if finished or now - start < self.delay_s or not self.console.is_terminal:
                if finished:
                    self.started.pop(phase, None)
                return
            self.tasks[phase] = self._bar().add_task(phase, total=total)
        self.bar.update(self.tasks[phase], completed=done, total=total)
        if finished:
            del self.tasks[phase]  # the finished bar stays on screen
            self.started.pop(phase, None)
            if not self.tasks:
                self.bar.stop()
                self.bar = None

    def _bar(self):
        if self.bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), console=self.console)
            self.bar.start()
        return self.bar
