"""``log_step_metrics=False`` keeps the strategy's ``roundpipe/*`` metrics out of the user's logger while
``step_metrics`` still measures them (issue 43, item 14)."""

import csv

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from _models import SeqModule, fit


class SeenMetrics(L.Callback):
    """The runtime's last step metrics at each batch end."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, *args):
        self.seen.append(dict(trainer.strategy.runtime.last_metrics))


def _logged_columns(tmp_path, **options):
    from lightning_roundpipe import RoundPipeStrategy

    seen = SeenMetrics()
    fit(SeqModule(), RoundPipeStrategy(microbatches=2, **options), devices=2, max_steps=2, record_grads=False,
        logger=CSVLogger(str(tmp_path), name="csv"), log_every_n_steps=1, callbacks=[seen])
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        return set(next(csv.reader(f))), seen.seen


@pytest.mark.timeout(90)
def test_metrics_stay_out_of_the_logger_but_are_still_measured(tmp_path):
    columns, seen = _logged_columns(tmp_path, log_step_metrics=False)
    assert "train_loss" in columns
    assert not [c for c in columns if c.startswith("roundpipe/")]
    assert len(seen) == 2 and all(m["step_s"] > 0 and 0 <= m["bubble_fraction"] <= 1 for m in seen)


@pytest.mark.timeout(90)
def test_by_default_they_are_logged(tmp_path):
    columns, _ = _logged_columns(tmp_path)
    assert {"roundpipe/bubble_fraction", "roundpipe/step_s", "roundpipe/memory/host_rss_bytes"} <= columns


def test_the_option_is_a_checked_flag():
    from lightning_roundpipe import RoundPipeStrategy

    with pytest.raises(Exception, match="log_step_metrics"):
        RoundPipeStrategy(log_step_metrics="no")
