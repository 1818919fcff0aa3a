"""Record the pipeline's per-task timeline for the first training steps and write it out.

Only a strategy that exposes a :class:`~lightning_roundpipe.trace.TraceRecorder` can be traced
(RoundPipe does); with any other strategy the callback says so once and does nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from ..trace import TraceRecorder

# Attribute names under which a strategy (or its engine / worker pool) may hold its recorder.
_RECORDER_PATHS = ("trace_recorder", "recorder", "trace", "engine.trace", "pool.trace", "engine.pool.trace")


def find_trace_recorder(strategy: Any) -> TraceRecorder | None:
    """The strategy's ``TraceRecorder``, looked up along ``_RECORDER_PATHS``; ``None`` if it has none."""
    for dotted in _RECORDER_PATHS:
        node = strategy
        for name in dotted.split("."):
            node = getattr(node, name, None)
            if node is None:
                break
        if isinstance(node, TraceRecorder):
            return node
    return None


class TraceWindow(pl.Callback):
    """Enables the recorder for training steps ``0 .. steps-1``; at the end writes
    ``trace.json`` (Chrome/Perfetto format) and, with matplotlib, ``trace.png`` to ``out_dir``.
    ``written`` lists the files afterwards."""

    def __init__(self, out_dir: str | Path, steps: int = 2):
        self.out_dir = Path(out_dir)
        self.steps = steps
        self.written: list[Path] = []
        self._warned = False

    def _recorder(self, trainer: pl.Trainer) -> TraceRecorder | None:
        recorder = find_trace_recorder(trainer.strategy)
        if recorder is None and not self._warned:
            rank_zero_warn(f"trace=true, but strategy {type(trainer.strategy).__name__} records no trace; use strategy=roundpipe")
            self._warned = True
        return recorder

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        recorder = self._recorder(trainer)
        if recorder is not None:
            recorder.step = trainer.global_step
            recorder.enabled = trainer.global_step < self.steps

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        recorder = self._recorder(trainer)
        if recorder is None or not trainer.is_global_zero:
            return
        recorder.enabled = False
        records = [r for r in recorder.records() if r.step < self.steps]
        if not records:
            return
        from .. import timeline  # export lives there; imported late to keep this module light

        self.out_dir.mkdir(parents=True, exist_ok=True)
        json_path = self.out_dir / "trace.json"
        timeline.to_chrome_trace(records, json_path)
        self.written.append(json_path)
        try:
            png_path = self.out_dir / "trace.png"
            timeline.save_gantt_png(records, png_path, title=f"first {self.steps} training steps")
            self.written.append(png_path)
        except ImportError:  # matplotlib is an optional extra
            pass
