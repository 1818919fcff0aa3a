"""The pipeline's step and memory metrics as a Lightning Callback, so they reach every logger.

After each training batch it logs, through ``LightningModule.log``, the step just timed
(``roundpipe/bubble_fraction``, ``exposed_transfer_s``, ``step_s``, ``tokens_per_s``, ``compile_s``),
memory (``roundpipe/memory/host_rss_bytes``, ``pinned_bytes``, ``w{i}_device_peak_bytes``) and,
with compiled layers, graph counts. ``roundpipe/step_s`` is the pipeline's span of the step, so
its tokens/s is above a wall-clock figure: read it against the plan's prediction. The strategy
adds this callback when ``step_metrics=True`` (the default). Each metric: docs/design.md, design
notes, ``lightning/step_metrics.py``.
"""

from __future__ import annotations

import lightning.pytorch as pl

METRICS = ("bubble_fraction", "exposed_transfer_s", "step_s", "compile_s", "tokens_per_s")


def memory_log_values(memory: dict) -> dict[str, float]:
    """The logged names and values of ``RoundPipeRuntime.memory_metrics``'s result."""
    values = {"roundpipe/memory/host_rss_bytes": float(memory["host_rss_bytes"]),
              "roundpipe/memory/pinned_bytes": float(memory["pinned_bytes"])}
    for worker, peak in enumerate(memory["device_peak_bytes"]):
        values[f"roundpipe/memory/w{worker}_device_peak_bytes"] = float(peak)
    return values


class RoundPipeStepMetrics(pl.Callback):
    """Log the pipeline's per-step and memory metrics; ``prog_bar`` also shows them in the progress bar.

    ``prog_bar`` is False by default: the progress bar keeps one throughput figure (the job's
    ``tokens_per_s``), the rest is for the loggers.
    """

    def __init__(self, prog_bar: bool = False):
        self.prog_bar = prog_bar

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if runtime is None:
            return
        measured = runtime.last_metrics
        values = {f"roundpipe/{k}": float(measured[k]) for k in METRICS if measured.get(k) is not None}
        values.update(memory_log_values(runtime.memory_metrics(reset_peaks=True)))
        compiled = runtime.compile_metrics()
        if compiled is not None:
            values.update({f"roundpipe/compile/{k}": float(v) for k, v in compiled.items()})
        pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=self.prog_bar, batch_size=1)
