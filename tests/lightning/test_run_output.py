"""What a fit prints and logs: the plan table agrees with the run, one throughput figure in the
progress bar, memory metrics in the loggers."""

from __future__ import annotations

import csv
import logging
import re

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from _models import SeqModule, make_data
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.finetune import TokenThroughput
from lightning_roundpipe.lightning.step_metrics import RoundPipeStepMetrics


class MicrobatchesRun(Callback):
    """Records how many microbatches the engine ran for each training batch."""

    def __init__(self):
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counts.append(trainer.strategy.runtime.engine.last_run.M)


def _trainer(tmp_path, strategy, callbacks=(), steps=2, **kw):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, log_every_n_steps=1,
                     enable_checkpointing=False, enable_model_summary=False, callbacks=list(callbacks),
                     default_root_dir=str(tmp_path), **kw)


@pytest.mark.timeout(90)
def test_plan_table_is_printed_once_and_shows_the_microbatches_that_ran(tmp_path, capsys, caplog):
    # Batches of 1 sample: the estimate before any batch picks 2 microbatches, the first batch can only split into 1.
    caplog.set_level(logging.INFO)
    ran = MicrobatchesRun()
    trainer = _trainer(tmp_path, RoundPipeStrategy(), [ran], logger=False, enable_progress_bar=False)
    data = DataLoader(make_data(n=8), batch_size=1)
    module = SeqModule()
    trainer.validate(module, data, verbose=False)  # validate, fit, validate: three runtimes, one plan
    trainer.fit(module, data)
    trainer.validate(module, data, verbose=False)
    text = caplog.text + capsys.readouterr().out
    assert text.count("RoundPipe pipelines `net`") == 1
    tables = re.findall(r"on 2 worker\(s\), (\d+) microbatch\(es\)", text)
    assert tables == ["1"]
    assert ran.counts == [1, 1]
    assert text.count("chosen for the first batch (1 samples); the estimate before any batch was seen gave 2") == 1
    assert "RoundPipe chose" not in text  # the choice is part of the table, not a message per runtime


@pytest.mark.timeout(90)
def test_plan_table_waits_for_nothing_when_the_microbatches_are_given(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO)
    strategy = RoundPipeStrategy(microbatches=2)
    trainer = _trainer(tmp_path, strategy, logger=False, enable_progress_bar=False, steps=1)
    trainer.fit(SeqModule(), DataLoader(make_data(n=8), batch_size=4))
    text = caplog.text + capsys.readouterr().out
    assert re.findall(r"on 2 worker\(s\), (\d+) microbatch\(es\)", text) == ["2"]
    assert "chosen for the first batch" not in text


class TokenBatches(L.LightningModule):
    """SeqModule's net, fed dict batches with input_ids so that TokenThroughput counts tokens."""

    def __init__(self):
        super().__init__()
        self.inner = SeqModule()

    def training_step(self, batch, batch_idx):
        return ((self.inner.net(batch["x"]) - batch["y"]) ** 2).mean()

    def configure_optimizers(self):
        return self.inner.configure_optimizers()


def _dict_batches(n=16, batch_size=4):
    import torch

    data = make_data(n=n)
    return DataLoader([{"x": x, "y": y, "input_ids": torch.zeros(3, dtype=torch.long)} for x, y in data],
                      batch_size=batch_size)


@pytest.mark.timeout(90)
def test_progress_bar_shows_one_throughput_figure_and_the_rest_goes_to_the_logger(tmp_path):
    trainer = _trainer(tmp_path, RoundPipeStrategy(microbatches=2, module="inner.net"), [TokenThroughput(warmup_batches=0)], steps=3,
                       logger=L.pytorch.loggers.CSVLogger(str(tmp_path), name="csv"), enable_progress_bar=True)
    trainer.fit(TokenBatches(), _dict_batches())
    shown = trainer.progress_bar_metrics
    assert [k for k in shown if "tokens_per_s" in k] == ["tokens_per_s"]
    assert not [k for k in shown if k.startswith("roundpipe/")]
    logged = set(trainer.logged_metrics)
    assert {"tokens_per_s", "roundpipe/tokens_per_s", "roundpipe/bubble_fraction",
            "roundpipe/memory/host_rss_bytes"} <= logged
    assert [cb.prog_bar for cb in trainer.callbacks if isinstance(cb, RoundPipeStepMetrics)] == [False]


@pytest.mark.timeout(90)
def test_progress_bar_metrics_option_shows_the_pipeline_metrics(tmp_path):
    trainer = _trainer(tmp_path, RoundPipeStrategy(microbatches=2, progress_bar_metrics=True), steps=2,
                       logger=False, enable_progress_bar=True)
    trainer.fit(SeqModule(), DataLoader(make_data(n=16), batch_size=4))
    shown = set(trainer.progress_bar_metrics)
    assert {"roundpipe/bubble_fraction", "roundpipe/step_s", "roundpipe/memory/w0_device_peak_bytes"} <= shown


def test_progress_bar_metrics_option_is_a_checked_flag():
    with pytest.raises(Exception, match="progress_bar_metrics"):
        RoundPipeStrategy(progress_bar_metrics="yes")


@pytest.mark.timeout(90)
def test_memory_metrics_reach_the_csv_logger_every_step(tmp_path):
    logger = L.pytorch.loggers.CSVLogger(str(tmp_path), name="csv")
    # Two forward stages, one per worker: both workers hold weights during every step.
    strategy = RoundPipeStrategy(microbatches=2, partition={"policy": "uniform", "forward_stages": 2})
    trainer = _trainer(tmp_path, strategy, steps=3, logger=logger, enable_progress_bar=False)
    trainer.fit(SeqModule(), DataLoader(make_data(n=16), batch_size=4))
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("roundpipe/memory/host_rss_bytes")]
    assert len(rows) == 3
    weights = sum(p.numel() * p.element_size() for p in SeqModule().net.parameters())
    for row in rows:
        rss = float(row["roundpipe/memory/host_rss_bytes"])
        assert 50 * 2**20 < rss < 64 * 2**30  # a Python process with torch and Lightning loaded
        assert float(row["roundpipe/memory/pinned_bytes"]) == 0.0  # the CPU backend pins nothing
        peaks = [float(row[f"roundpipe/memory/w{i}_device_peak_bytes"]) for i in range(2)]
        # Each worker held its stage's weights during the step, never more than all of them twice
        # over (a stage and the next one's prefetch).
        assert all(0 < p <= 2 * weights for p in peaks), (peaks, weights)


@pytest.mark.timeout(60)
def test_memory_metrics_of_the_stream_backend_count_pinned_bytes_and_restart_the_peaks():
    import torch
    from torch import nn

    from lightning_roundpipe.runtime import RoundPipeRuntime, RuntimeOptions

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    rt = RoundPipeRuntime.attach(net, "fake_cuda", 2, RuntimeOptions(microbatches=2, partition="uniform",
                                                                     overlap_optimizer=False))
    try:
        net(torch.randn(8, 64)).sum().backward()
        rt.pool.drain()
        first = rt.memory_metrics()
        # pinned="alloc": every weight the uploads read is pinned in place, plus the download buffers kept
        assert first["pinned_bytes"] >= weights
        assert first["device_peak_bytes"] == [weights // 2, weights // 2]  # two layers' weights per worker
        assert first["host_rss_bytes"] > 0
        assert rt.memory_metrics()["device_peak_bytes"] == [0, 0]  # nothing held between steps: the peak restarted
    finally:
        rt.detach()
