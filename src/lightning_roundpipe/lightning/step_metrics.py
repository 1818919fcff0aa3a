"""The pipeline's step and memory metrics as a Lightning Callback, so they reach every logger.

After each training batch, the metrics of the step the runtime just timed
(``lightning_roundpipe.tracing.timeline.step_metrics``) are logged through
``LightningModule.log``:

- ``roundpipe/bubble_fraction``, ``roundpipe/exposed_transfer_s``, ``roundpipe/step_s`` (the
  pipeline's span of the step: first task start to last task end, less ``roundpipe/compile_s``, the
  seconds ``torch.compile`` took during the step) and ``roundpipe/tokens_per_s``
  (the batch's tokens over that span, the last only when the batch has a token count). The span
  leaves out the host's loss, the optimizer's tail and the training loop, so this figure is
  above a wall-clock one such as the fine-tuning job's ``tokens_per_s``
  (``TokenThroughput``): read it against the plan's prediction;
- memory, as torchtitan logs it every logging step: ``roundpipe/memory/host_rss_bytes`` (this
  process's resident memory, where the weights, optimizer state and activations live),
  ``roundpipe/memory/pinned_bytes`` (page-locked host memory; 0 on the CPU backend) and
  ``roundpipe/memory/w{i}_device_peak_bytes`` (the most device bytes worker ``i`` held during the
  step; see ``RoundPipeRuntime.memory_metrics``);
- with compiled layers, ``roundpipe/compile/graphs`` and ``roundpipe/compile/recompiles`` (the graphs
  dynamo holds for the process's compiled layer calls, and those beyond the first of each compiled
  callable) and ``roundpipe/compile/compile_seconds`` (``RoundPipeRuntime.compile_metrics``).

They go to the loggers only; ``prog_bar=True`` (the strategy option ``progress_bar_metrics``)
shows them in the progress bar too. The strategy adds this callback when ``step_metrics=True``
(the default) and none is given.
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
