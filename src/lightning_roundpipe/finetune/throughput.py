"""Training throughput in tokens per second, measured around each training batch."""

from __future__ import annotations

import time
from typing import Any, Mapping

import lightning.pytorch as pl
import torch


def batch_tokens(batch: Any) -> int:
    """Tokens a batch trains on: attended positions if there is a mask, else all ``input_ids``."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if mask is not None:
            return int(mask.sum())
        return int(batch["input_ids"].numel())
    raise TypeError(f"cannot count tokens of a {type(batch).__name__} batch; expected a dict with input_ids")


def _synchronize_cuda() -> None:
    """Wait for queued GPU work, so the clock reads finished work (no-op without CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


class TokenThroughput(pl.Callback):
    """Logs ``tokens_per_s``, the job's one throughput figure (the progress bar shows it, and the
    end-of-run summary prints its final value): tokens per wall second of the training steps.

    Definition: the attended tokens of this process's training batches counted so far, over the
    wall time of those batches, each timed from ``on_train_batch_start`` to ``on_train_batch_end``
    (forward, backward and, on the last accumulation step, the optimizer step; data loading is
    excluded; CUDA is synchronised at both ends). The first ``warmup_batches`` are not counted:
    they pay one-off costs (allocation, plan building). It is measured the same way under every
    strategy, so a RoundPipe run and Lightning's default strategy compare directly. The strategy's
    ``roundpipe/tokens_per_s`` (loggers only) times the pipeline's span of a step instead, which
    leaves out the host's share, so it reads higher. After training, ``tokens``, ``seconds`` and
    ``tokens_per_s`` hold the totals.
    """

    def __init__(self, warmup_batches: int = 1, name: str = "tokens_per_s"):
        self.warmup_batches = warmup_batches
        self.name = name
        self.tokens = 0
        self.seconds = 0.0
        self._batches_seen = 0
        self._started: float | None = None

    @property
    def tokens_per_s(self) -> float:
        """Measured rate so far; 0.0 before any counted batch."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.tokens, self.seconds, self._batches_seen = 0, 0.0, 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        _synchronize_cuda()
        self._started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        _synchronize_cuda()
        elapsed = time.perf_counter() - self._started
        self._batches_seen += 1
        if self._batches_seen <= self.warmup_batches:
            return
        self.tokens += batch_tokens(batch)
        self.seconds += elapsed
        pl_module.log(self.name, self.tokens_per_s, on_step=True, on_epoch=False, prog_bar=True)
