"""Step metrics follow Lightning's conventions: every logger, the progress bar, beside Lightning's monitors."""

import csv
import warnings

import lightning as L
import pytest
from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader

from _models import SeqModule, make_data
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.lightning.step_metrics import RoundPipeStepMetrics

KEYS = ("roundpipe/bubble_fraction", "roundpipe/exposed_transfer_s", "roundpipe/step_s", "roundpipe/tokens_per_s")


FLOPS_PER_BATCH = 1000


def _fit(tmp_path, strategy, callbacks=(), steps=3, **kw):
    loggers = [CSVLogger(str(tmp_path), name="csv"), TensorBoardLogger(str(tmp_path), name="tb")]
    m = SeqModule(scheduler=True)
    m.flops_per_batch = FLOPS_PER_BATCH  # what ThroughputMonitor asks a module for
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, logger=loggers,
                        log_every_n_steps=1, enable_checkpointing=False, enable_model_summary=False,
                        callbacks=list(callbacks), default_root_dir=str(tmp_path), **kw)
    trainer.fit(m, DataLoader(make_data(), batch_size=8))
    return trainer


def _csv_rows(tmp_path):
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _tensorboard_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_step_metrics_reach_csv_tensorboard_and_on_request_the_progress_bar(tmp_path):
    trainer = _fit(tmp_path, RoundPipeStrategy(microbatches=4, progress_bar_metrics=True), enable_progress_bar=True)
    rows = _csv_rows(tmp_path)
    tags = _tensorboard_tags(tmp_path)
    for key in KEYS:
        logged = [float(r[key]) for r in rows if r.get(key)]
        assert len(logged) == 3 and all(v >= 0 for v in logged), key
        assert len(tags[key]) == 3 and tags[key] == pytest.approx(logged, rel=1e-6)
    assert all(0 <= v <= 1 for v in tags["roundpipe/bubble_fraction"])
    assert tags["roundpipe/tokens_per_s"][0] > 0
    shown = trainer.progress_bar_metrics
    assert set(KEYS) <= set(shown)
    assert sum(isinstance(cb, RoundPipeStepMetrics) for cb in trainer.callbacks) == 1


def test_step_metrics_work_beside_lr_monitor_and_throughput_monitor(tmp_path):
    monitors = [LearningRateMonitor(logging_interval="step"), ThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0], window_size=2)]
    _fit(tmp_path, RoundPipeStrategy(microbatches=2), callbacks=monitors, steps=4, enable_progress_bar=False)
    rows = _csv_rows(tmp_path)
    header = set(rows[0])
    assert {"lr-SGD", "roundpipe/bubble_fraction"} <= header
    assert {"train/device/samples_per_sec", "train/samples"} <= header, sorted(header)  # as under the default strategy
    assert all(float(r["train/device/samples_per_sec"]) > 0 for r in rows if r.get("train/device/samples_per_sec"))
    assert any(float(r["train/device/flops_per_sec"]) > 0 for r in rows if r.get("train/device/flops_per_sec"))
    lrs = [float(r["lr-SGD"]) for r in rows if r.get("lr-SGD")]
    assert lrs[:4] == pytest.approx([0.1, 0.1, 0.1, 0.1])  # StepLR by epoch: unchanged within the first epoch


def test_step_metrics_can_be_turned_off(tmp_path):
    trainer = _fit(tmp_path, RoundPipeStrategy(microbatches=2, step_metrics=False), steps=2, enable_progress_bar=False)
    assert not any(isinstance(cb, RoundPipeStepMetrics) for cb in trainer.callbacks)
    assert not any(k.startswith("roundpipe/") for k in _csv_rows(tmp_path)[0])


def test_our_calls_into_lightning_raise_no_warnings(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, RoundPipeStrategy(microbatches=2), steps=2, enable_progress_bar=False)
    ours = [w for w in caught if "lightning_roundpipe" in (w.filename or "") or "roundpipe" in str(w.message).lower()]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    # what Lightning says because of how it is called (not of the user's set-up): batch-size inference, logging
    lightning_about_us = [w for w in caught if "batch_size" in str(w.message) or "self.log" in str(w.message)]
    assert not lightning_about_us, [str(w.message) for w in lightning_about_us]


def test_plan_table_is_printed_once_on_rank_zero(tmp_path, capsys, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    _fit(tmp_path, RoundPipeStrategy(microbatches=2), steps=1, enable_progress_bar=False)
    text = caplog.text + capsys.readouterr().out
    assert text.count("RoundPipe pipelines `net`") == 1
