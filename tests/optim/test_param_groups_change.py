"""Issue 43, item 1: parameters that join the optimizer during training (``BaseFinetuning``'s
``unfreeze_and_add_param_group``, ``add_param_group`` with a head at epoch 1), parameters frozen
or unfrozen, and hyper-parameters changed between steps are stepped exactly by the overlapped
optimizer (forced on: this host's default leaves it off), against Lightning's default strategy."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn

from _exact_models import LAYERED, WEIGHT_TOL, SeqModule, weight_error, weights
from _models import fit, make_data
from lightning_roundpipe import RoundPipeStrategy

STRATEGY = {"microbatches": 2, **LAYERED}  # overlap_optimizer=True, several backward stages
DATA = make_data(n=16)  # two steps per epoch
STEPS = 5  # epochs 0-2: the changes at epoch 1 take part in three steps


class Optimized(SeqModule):
    """Records whether the overlapped optimizer ran, so a test cannot pass on the whole-step path."""

    overlapped = None

    def on_train_start(self):
        runtime = getattr(self.trainer.strategy, "runtime", None)
        self.overlapped = None if runtime is None else len(runtime.overlapped)


class BackboneUnfreeze(BaseFinetuning):
    """Trains the last two layers first, then unfreezes the rest as a new group at epoch 1."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.net[:-2])

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net[:-2], optimizer, lr=0.05, initial_denom_lr=1.0)


class HeadOnly(Optimized):
    def configure_optimizers(self):
        params = [p for p in self.net[-2:].parameters()]
        if self.opt == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(params, lr=self.lr * 0.1, weight_decay=0.01)


class NewHeadAtEpochOne(Optimized):
    """A head outside the pipelined ``net`` and the pipeline's layer 1 join the optimizer at epoch 1
    (they get gradients, which the optimizer does not clear, from the start)."""

    def __init__(self, opt):
        super().__init__(opt=opt)
        torch.manual_seed(3)
        self.extra = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.extra(self.net(x)) - y) ** 2).mean()

    def configure_optimizers(self):
        late = {id(p) for p in self.net[1].parameters()}
        params = [p for p in self.net.parameters() if id(p) not in late]
        if self.opt == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(params, lr=self.lr * 0.1, weight_decay=0.01)

    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            group = {"params": [*self.extra.parameters(), *self.net[1].parameters()]}
            self.optimizers().optimizer.add_param_group(group)


class ChangesBetweenSteps(Optimized):
    """Layer 2 frozen at step 1 and unfrozen at step 3; the second group's lr and weight decay
    changed and layer 3 taken out of it at step 2; a group's parameter list extended in place at step 3."""

    def configure_optimizers(self):
        params = list(self.net.parameters())
        groups = [{"params": params[:4]}, {"params": params[4:-2]}]
        self.moved = params[-2:]  # join group 0 at step 3
        if self.opt == "sgd":
            return torch.optim.SGD(groups, lr=self.lr, momentum=0.9, weight_decay=0.0)
        return torch.optim.AdamW(groups, lr=self.lr * 0.1, weight_decay=0.01)

    def on_train_batch_start(self, batch, batch_idx):
        step = self.global_step
        if step == 1:
            self.net[2].requires_grad_(False)
        if step == 2:
            group = self.optimizers().optimizer.param_groups[1]
            group["lr"] *= 3
            group["weight_decay"] = 0.1
            left = {id(p) for p in self.net[3].parameters()}
            group["params"] = [p for p in group["params"] if id(p) not in left]  # layer 3 leaves the optimizer
        if step == 3:
            self.net[2].requires_grad_(True)
            self.optimizers().optimizer.param_groups[0]["params"].extend(self.moved)


class AddedInsideTrainingStep(Optimized):
    """Layer 1's bias joins at step 2 from inside ``training_step``: its layer's weight may have
    stepped early during that backward, so the bias steps on its own after the closure."""

    def configure_optimizers(self):
        params = [p for p in self.net.parameters() if p is not self.net[1][0].bias]
        if self.opt == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(params, lr=self.lr * 0.1, weight_decay=0.01)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 2:
            self.optimizers().optimizer.add_param_group({"params": [self.net[1][0].bias], "lr": 0.02})
        return loss


CASES = {
    "added_inside_training_step": (AddedInsideTrainingStep, lambda: []),
    "base_finetuning": (HeadOnly, lambda: [BackboneUnfreeze()]),
    "add_param_group_head": (NewHeadAtEpochOne, lambda: []),
    "frozen_unfrozen_hyperparameters": (ChangesBetweenSteps, lambda: []),
}


def _error(case, opt, steps=STEPS):
    make, callbacks = CASES[case]
    ref = make(opt=opt)
    w0 = weights(ref)
    fit(ref, "auto", max_steps=steps, data=DATA, callbacks=callbacks(), record_grads=False)
    m = make(opt=opt)
    assert all(torch.equal(a, b) for a, b in zip(weights(m).values(), w0.values()))
    fit(m, RoundPipeStrategy(**STRATEGY), devices=2, max_steps=steps, data=DATA, callbacks=callbacks(),
        record_grads=False)
    assert m.overlapped == 1, "the overlapped optimizer did not run"
    return weight_error(weights(m), weights(ref), w0)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_changes_during_training_are_stepped_exactly(case, opt):
    assert _error(case, opt) < WEIGHT_TOL
