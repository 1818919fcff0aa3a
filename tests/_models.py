"""Small LightningModules and a runner shared by the strategy tests."""

from __future__ import annotations

import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe  # noqa: F401  (registers "roundpipe")
from lightning_roundpipe import RoundPipeStrategy

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")


def make_data(n=40, width=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g))


def mlp(depth=6, width=16, dropout=0.0, seed=0):
    """``depth`` blocks of Linear + Tanh (+ Dropout), initialised from ``seed``."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        block = [nn.Linear(width, width), nn.Tanh()]
        if dropout:
            block.append(nn.Dropout(dropout))
        layers.append(nn.Sequential(*block))
    return layers


class LossHead(nn.Module):
    """Last layer of a fused plan: returns the microbatch's summed loss."""

    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return {"loss_sum": (self.proj(x) ** 2).sum()}


class SeqModule(L.LightningModule):
    """An MLP in an nn.Sequential: the usual way a user would write it."""

    def __init__(self, width=8, depth=4, opt="sgd", lr=0.1, scheduler=False, frozen=False, tied=False, dropout=0.0,
                 manual=False, seed=0, scheduler_interval="epoch"):
        super().__init__()
        blocks = mlp(depth, width, dropout, seed)
        head = nn.Linear(width, width)
        if tied:
            head.weight = blocks[0][0].weight  # one Parameter used by two layers
        self.net = nn.Sequential(*blocks, head, nn.Linear(width, 1))
        if frozen:
            for p in self.net[1].parameters():
                p.requires_grad_(False)
        self.opt, self.lr, self.use_scheduler, self.scheduler_interval = opt, lr, scheduler, scheduler_interval
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("train_loss", loss)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("val_loss", loss)
        return loss

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.opt == "sgd":
            opt = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(params, lr=self.lr * 0.1, weight_decay=0.01)
        if self.use_scheduler:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.scheduler_interval}}
        return opt


class GradRecorder(L.Callback):
    """Keeps the gradients seen before the first optimizer step."""

    def __init__(self):
        self.first = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.first is None:
            self.first = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def fit(module, strategy, devices=1, max_steps=5, batch_size=8, data=None, callbacks=(), record_grads=True,
        **trainer_kwargs):
    rec = GradRecorder()
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    options.update(trainer_kwargs)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        callbacks=[rec, *callbacks] if record_grads else list(callbacks),
        **options,
    )
    trainer.fit(module, DataLoader(data or make_data(), batch_size=batch_size))
    return trainer, rec.first


def roundpipe(workers=2, **kwargs):
    return RoundPipeStrategy(**kwargs), workers


def weights(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def grad_error(g, g_ref):
    """Worst per-tensor ||g - g_ref|| / ||g_ref||."""
    assert g.keys() == g_ref.keys()
    return max(((g[k] - g_ref[k]).norm() / g_ref[k].norm()).item() for k in g_ref)


def weight_error(w, w_ref, w_init):
    """Worst per-tensor ||w - w_ref|| / ||w_ref - w_init|| over tensors that moved."""
    errs = [((w[k] - w_ref[k]).norm() / (w_ref[k] - w_init[k]).norm()).item()
            for k in w_ref if (w_ref[k] - w_init[k]).norm() > 0]
    assert errs, "no weight moved"
    return max(errs)


class InjectedBackwardFailure(RuntimeError):
    """What ``FailingBackward`` raises."""


class FailingBackward(torch.autograd.Function):
    """Identity whose backward counts its runs in ``state["backwards"]`` and raises
    ``InjectedBackwardFailure`` on run number ``state["fail_at"]`` (1: the first)."""

    @staticmethod
    def forward(ctx, x, state):
        ctx.state = state
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.state["backwards"] += 1
        if ctx.state["backwards"] == ctx.state["fail_at"]:
            raise InjectedBackwardFailure(f"injected failure in backward number {ctx.state['fail_at']}")
        return g, None
