"""Device memory kept alive until the stream work that reads it has finished: frees ordered by events.

The stream backends do not use ``Tensor.record_stream``. It marks a tensor so that, when freed,
the caching allocator records an event on the marked stream *at the moment of the free* and only
reuses the memory after it: a stage's weights, freed by a release that runs after the next
stage's microbatches are already queued on the compute stream, then wait for all of those.
Instead each cross-stream reader records its own event right after its last use (the compute's
end event, a download's copy event) and the tensors it read are held here until that event has
completed, then dropped: the memory goes back to its stream's pool exactly when the last reader
is done, and nothing later holds it.
"""

from __future__ import annotations

import collections
import threading
from typing import Any


class StreamHolds:
    """Per stream, objects held until an event recorded on that stream completes (events of one
    stream complete in order, so only the oldest of each stream is ever checked)."""

    def __init__(self) -> None:
        # Keyed by the stream itself: CUDA's stream objects compare and hash by their handle, so two
        # objects for one stream (``current_stream()`` makes a new one per call) share a queue.
        self._by_stream: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()
        self.held = 0  # entries now held
        self.holds = 0  # over the pool's life

    def hold(self, stream: Any, event: Any, objs: list) -> None:
        """Keep ``objs`` alive until ``event`` on ``stream`` completes."""
        if not objs:
            return
        with self._lock:
            self._by_stream[stream].append((event, objs))
            self.held += 1
            self.holds += 1

    @property
    def queue_count(self) -> int:
        """How many per-stream queues the bookkeeping keeps (``collect`` scans each of them)."""
        with self._lock:
            return len(self._by_stream)

    def collect(self) -> int:
        """Drop what every finished event held; returns how many entries went."""
        dropped = []
        with self._lock:
            for key, q in list(self._by_stream.items()):
                while q and q[0][0].query():
                    dropped.append(q.popleft())
                if not q:  # bounded bookkeeping whatever the callers key by
                    del self._by_stream[key]
            self.held -= len(dropped)
        n = len(dropped)
        del dropped  # the tensors are freed here, outside the lock
        return n

    def clear(self) -> None:
        """After the streams were synchronized (or stopped): nothing can still read what is held."""
        with self._lock:
            self._by_stream.clear()
            self.held = 0
