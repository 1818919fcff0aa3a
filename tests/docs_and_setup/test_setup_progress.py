"""Set-up progress: the callback hears the right totals; the rich display draws only on a terminal and
only for phases that last; the plan table is printed once per plan across Trainer calls."""

import io
import logging
import os

import lightning.pytorch as pl
import pytest
import torch
from rich.console import Console
from torch import nn

import lightning_roundpipe  # noqa: F401  (registers the strategy)
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.cost.estimate import ESTIMATE_PHASE, estimate_costs
from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.options import PartitionConfig, RuntimeOptions
from lightning_roundpipe.lightning.checkpoint_io import LOAD_PHASE, AtomicCheckpointIO
from lightning_roundpipe.planning import search
from lightning_roundpipe.planning.partition import partition
from lightning_roundpipe.runtime import RoundPipeRuntime
from lightning_roundpipe.setup_progress import RichSetupProgress


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, phase, done, total):
        self.calls.append((phase, done, total))

    def of(self, phase):
        return [(d, t) for p, d, t in self.calls if p == phase]


def _costs(n):
    return CostProfile([LayerCost(1e-3 * (1 + i % 3), 1e-3, 2e-3, 1000, 1000, 100) for i in range(n)],
                       tokens_per_microbatch=16)


def _assert_runs_to_total(seen, total):
    assert seen and all(t == total for _, t in seen)
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == total and all(d < total for d in done[:-1])


def test_estimate_reports_every_layer():
    rec = Recorder()
    layers = [nn.Linear(4, 4) for _ in range(5)]
    estimate_costs(layers, 16, None, torch.float32, progress=rec)
    assert rec.of(ESTIMATE_PHASE) == [(i, 5) for i in range(6)]


def test_exhaustive_search_reports_the_whole_space():
    rec = Recorder()
    n = 6  # 1 + sum(4**(h-1)) = 1366 plans with a fused last stage: searched exhaustively
    partition("auto", _costs(n), 2, 4, fused_last=True, progress=rec)
    space = 1 + sum(4 ** (h - 1) for h in range(1, n))
    seen = rec.of(search.SEARCH_PHASE)
    _assert_runs_to_total(seen, space)
    assert len(seen) == space // search.PROGRESS_EVERY + 1


def test_local_search_reports_against_its_evaluation_budget():
    rec = Recorder()
    partition("auto", _costs(24), 4, 8, fused_last=True, progress=rec)
    _assert_runs_to_total(rec.of(search.SEARCH_PHASE), search.MAX_EVALUATIONS)


def test_other_policies_and_no_callback_stay_silent():
    rec = Recorder()
    partition("uniform", _costs(24), 4, 8, progress=rec)
    assert rec.calls == []
    assert partition("auto", _costs(6), 2, 4) == partition("auto", _costs(6), 2, 4, progress=rec)


def test_runtime_passes_progress_to_estimate_and_search():
    rec = Recorder()
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    options = RuntimeOptions(partition=PartitionConfig(policy="auto"))
    runtime = RoundPipeRuntime.attach(net, num_workers=2, options=options, progress=rec)
    try:
        assert rec.of(ESTIMATE_PHASE)[-1] == (4, 4)
        assert rec.of(search.SEARCH_PHASE)[-1][0] == rec.of(search.SEARCH_PHASE)[-1][1]
    finally:
        runtime.detach()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _drive(display, clock, seconds_per_step, steps=10):
    for i in range(steps + 1):
        display("phase A", i, steps)
        clock.now += seconds_per_step


@pytest.mark.parametrize("terminal,seconds_per_step,drawn", [
    (True, 0.5, True),     # 5 s on a terminal: drawn
    (True, 0.05, False),   # 0.5 s, under the 1 s threshold: nothing
    (False, 0.5, False),   # not a terminal (a log file, a pipe): nothing
])
def test_rich_display_draws_only_long_phases_on_a_terminal(terminal, seconds_per_step, drawn):
    out = io.StringIO()
    clock = Clock()
    display = RichSetupProgress(console=Console(file=out, force_terminal=terminal, width=80), clock=clock)
    _drive(display, clock, seconds_per_step)
    text = out.getvalue()
    assert ("phase A" in text and "10/10" in text) if drawn else text == ""
    assert display.bar is None  # finished phases leave no live display behind


def test_checkpoint_load_reports_bytes_read(tmp_path):
    path = tmp_path / "c.ckpt"
    state = {"state_dict": {"w": torch.arange(100000.0)}}
    torch.save(state, path)
    rec = Recorder()
    loaded = AtomicCheckpointIO(progress=lambda: rec).load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"])
    seen = rec.of(LOAD_PHASE)
    size = os.path.getsize(path)
    assert seen[-1] == (size, size) and all(t == size for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert torch.equal(AtomicCheckpointIO().load_checkpoint(path)["state_dict"]["w"], state["state_dict"]["w"])


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))

    def _loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, _):
        return self._loss(batch)

    def validation_step(self, batch, _):
        self.log("val", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _loader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)

    def train_dataloader(self):
        return self._loader()

    def val_dataloader(self):
        return self._loader()


def test_plan_table_printed_once_for_validate_fit_validate(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    model = Tiny()
    trainer = pl.Trainer(strategy=RoundPipeStrategy(microbatches=2), accelerator="cpu", devices=2, max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.validate(model)
    trainer.fit(model)
    trainer.validate(model)
    text = caplog.text + capsys.readouterr().out
    assert text.count("RoundPipe pipelines `net`") == 1
    assert "RoundPipe:" not in text.replace("RoundPipe pipelines", "")  # no progress bar off a terminal
    # another plan (here: of a deeper module) is announced again, once
    deeper = Tiny()
    deeper.net = nn.Sequential(*deeper.net, nn.Tanh(), nn.Linear(1, 1))
    trainer.validate(deeper)
    trainer.validate(deeper)
    text = caplog.text + capsys.readouterr().out
    assert text.count("RoundPipe pipelines `net`") == 2
