"""``overlap_optimizer=None``: the optimizer overlaps only where the host has a core to spare."""

import lightning as L
import pytest
import torch

from _models import SeqModule, fit, weights
from lightning_roundpipe import RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.options import overlap_rule as options_module  # where the default rule reads the cores
from lightning_roundpipe.options import OptionError, overlap_optimizer_default


@pytest.mark.parametrize("backend,workers,threads,cores,expected", [
    ("cpu", 2, 1, 2, False),   # this machine: both cores are the workers'
    ("cpu", 2, 1, 3, False),   # 2 workers + the host thread take all 3
    ("cpu", 2, 1, 4, True),    # one core left for the optimizer thread
    ("cpu", 2, 2, 5, False),   # 2 x 2 worker threads + host = 5
    ("cpu", 2, 2, 6, True),
    ("cpu", 1, 1, 2, False),
    ("cuda", 8, 4, 10, True),  # a GPU worker keeps one launching thread busy, whatever cpu_threads_per_worker says
    ("cuda", 8, 1, 9, False),
    ("cuda", 8, 1, 64, True),
])
def test_the_rule_counts_worker_threads_and_the_host_thread(backend, workers, threads, cores, expected):
    assert overlap_optimizer_default(backend, workers, threads, cores) is expected


def test_set_values_win_and_staleness_always_overlaps():
    assert RuntimeOptions().overlap_optimizer is None
    assert RuntimeOptions(overlap_optimizer=True).overlaps_optimizer("cpu", 2, cores=2) is True
    assert RuntimeOptions(overlap_optimizer=False).overlaps_optimizer("cpu", 2, cores=64) is False
    assert RuntimeOptions().overlaps_optimizer("cpu", 2, cores=2) is False
    assert RuntimeOptions().overlaps_optimizer("cpu", 2, cores=4) is True
    assert RuntimeOptions(cpu_threads_per_worker=2).overlaps_optimizer("cpu", 2, cores=4) is False
    assert RuntimeOptions(staleness=1).validate().overlaps_optimizer("cpu", 2, cores=2) is True
    with pytest.raises(OptionError, match=r"RuntimeOptions\(overlap_optimizer='yes'\).*must be True or False"):
        RuntimeOptions(overlap_optimizer="yes").validate()


class CountOverlapped(L.Callback):
    def __init__(self):
        self.overlapped = None

    def on_train_batch_end(self, trainer, *args):
        self.overlapped = len(trainer.strategy.runtime.overlapped)


@pytest.mark.timeout(60)
def test_the_strategy_resolves_the_default_from_the_hosts_cores(monkeypatch):
    """Two CPU workers: 2 cores step whole after backward, 4 cores overlap; both exact (bit-identical)."""
    results = {}
    for cores in (2, 4):
        monkeypatch.setattr(options_module, "usable_cores", lambda cores=cores: cores)
        module, seen = SeqModule(opt="adamw"), CountOverlapped()
        fit(module, RoundPipeStrategy(microbatches=2), devices=2, max_steps=2, callbacks=[seen], record_grads=False)
        results[cores] = (seen.overlapped, weights(module))
    assert results[2][0] == 0 and results[4][0] == 1
    for name, w in results[2][1].items():
        assert torch.equal(w, results[4][1][name]), name
