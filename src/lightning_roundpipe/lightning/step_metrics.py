"""The pipeline's step metrics as a Lightning Callback, so they reach every logger and the progress bar.

After each training batch, the metrics of the step the runtime just timed
(``lightning_roundpipe.tracing.timeline.step_metrics``) are logged through
``LightningModule.log``: ``roundpipe/bubble_fraction``, ``roundpipe/exposed_transfer_s``,
``roundpipe/step_s`` and ``roundpipe/tokens_per_s`` (the last only when the batch has a token count).
The strategy adds this callback when ``step_metrics=True`` (the default) and none is given.
"""

from __future__ import annotations

import lightning.pytorch as pl

METRICS = ("bubble_fraction", "exposed_transfer_s", "step_s", "tokens_per_s")


class RoundPipeStepMetrics(pl.Callback):
    """Log the pipeline's per-step metrics; ``prog_bar`` also shows them in the progress bar."""

    def __init__(self, prog_bar: bool = True):
        self.prog_bar = prog_bar

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        measured = runtime.last_metrics if runtime is not None else {}
        values = {f"roundpipe/{k}": float(measured[k]) for k in METRICS if measured.get(k) is not None}
        if values:
            pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=self.prog_bar, batch_size=1)
