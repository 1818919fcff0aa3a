"""A first batch longer than the plan's estimate is checked against the memory cap before any layer
runs (issue 43, item 12): the plan is priced for 512 tokens per microbatch until a batch is seen,
and a cap that fits those but not the real microbatches used to be found out by a worker's
allocation, after the first stages had run."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _models import weights
from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.schedule.plan import PlanError


class CountedLinear(nn.Linear):
    """A Linear that counts its forward calls (on any worker) in ``calls``."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


def narrow_then_wide(seed=0):
    """Two narrow layers, then one whose output is 32 times wider: its activations break the cap."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Sequential(CountedLinear(8, 8), nn.Tanh()), nn.Sequential(CountedLinear(8, 8), nn.Tanh()),
                         nn.Sequential(CountedLinear(8, 256), nn.Tanh()), CountedLinear(256, 1))


# A stage may use half the cap (1.2 MB): 512-row microbatches (the estimate) fit every layer (the wide
# one: 0.5 MB of activations); 3,000-row ones fit the narrow layers (96 KB) but not the wide one (3 MB).
CAP = 2_400_000
ROWS = 6_000  # 2 microbatches of 3,000 rows


class Regression(L.LightningModule):
    def __init__(self, opt):
        super().__init__()
        self.net, self.opt = narrow_then_wide(), opt

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=0.01)


@pytest.mark.timeout(60)
def test_runtime_refuses_the_first_long_batch_before_any_layer_runs():
    net = narrow_then_wide()
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, cpu_memory_cap_bytes=CAP,
                                                               step_metrics=False))
    try:
        assert rt.planner.budget_checked_tokens == 512  # the estimate fitted the cap
        CountedLinear.calls = 0
        with pytest.raises(PlanError, match=r"^layer 2 needs .*Raise cpu_memory_cap_bytes, use fewer tokens per microbatch"):
            net(torch.randn(ROWS, 8)).square().mean().backward()
        assert CountedLinear.calls == 0
        assert all(p.grad is None for p in net.parameters())
        net(torch.randn(16, 8)).square().mean().backward()  # a batch that fits runs
        assert CountedLinear.calls >= 4 * 2  # every layer ran forward on both microbatches
    finally:
        rt.detach()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_fit_refuses_the_first_long_batch_before_any_layer_runs_and_weights_stay(opt):
    module = Regression(opt)
    before = weights(module)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 1, generator=g)),
                      batch_size=ROWS)
    trainer = L.Trainer(strategy=RoundPipeStrategy(microbatches=2, cpu_memory_cap_bytes=CAP, overlap_optimizer=True),
                        accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    CountedLinear.calls = 0
    with pytest.raises(PlanError, match=r"layer 2 needs .*one microbatch's activations"):
        trainer.fit(module, data)
    assert CountedLinear.calls == 0
    assert all(torch.equal(w, before[k]) for k, w in weights(module).items())
