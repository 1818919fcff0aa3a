"""A tiny Hugging Face causal LM under Lightning, and parity runs against the default strategy
(tests/adapters/test_user_loss.py, tests/lightning/test_bf16_mixed_parity.py)."""

from __future__ import annotations

import contextlib

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from _exact_models import weight_error
from _family_configs import family_batch
from lightning_roundpipe import RoundPipeStrategy

STEPS = 3


class LMModule(L.LightningModule):
    def __init__(self, model, opt="sgd", autocast=False, pieces=1):
        super().__init__()
        self.model, self.opt, self.autocast, self.pieces = model, opt, autocast, pieces

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        # autocast=False leaves the precision plugin's own autocast alone (enabled=False would turn it off)
        with torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext():
            if self.pieces == 1:
                return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
            # the same loss summed from microbatches (HF sums and divides by num_items_in_batch): the floor
            items = int((labels[:, 1:] != -100).sum())
            return sum(self.model(input_ids=i, attention_mask=m, labels=l, num_items_in_batch=items).loss
                       for i, m, l in zip(ids.tensor_split(self.pieces), mask.tensor_split(self.pieces),
                                          labels.tensor_split(self.pieces)))

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)


def fit_lm(module, strategy, devices=1, steps=STEPS, precision="32-true"):
    """Train ``module`` for ``steps`` SGD/AdamW steps on the family batch; its model's weights after."""
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision=precision)
    trainer.fit(module, DataLoader(TensorDataset(*family_batch("right")), batch_size=6))
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


def lm_error(make, opt, strategy_kwargs=None, steps=STEPS, precision="32-true", **module_kwargs):
    """||w - w_ref|| / ||w_ref - w_init|| (worst tensor) of RoundPipe (3 microbatches, 2 workers)
    against the default strategy, both at ``precision``."""
    w0 = {n: p.detach().clone() for n, p in make().named_parameters()}
    ref = fit_lm(LMModule(make(), opt, **module_kwargs), "auto", steps=steps, precision=precision)
    got = fit_lm(LMModule(make(), opt, **module_kwargs), RoundPipeStrategy(microbatches=3, **(strategy_kwargs or {})),
                 devices=2, steps=steps, precision=precision)
    return weight_error(got, ref, w0)


def lm_floor(make, opt, steps=STEPS, precision="32-true", **module_kwargs):
    """The default strategy against itself, the loss summed from three microbatches against one batch:
    the summation-order floor bounds are stated as multiples of."""
    w0 = {n: p.detach().clone() for n, p in make().named_parameters()}
    whole = fit_lm(LMModule(make(), opt, **module_kwargs), "auto", steps=steps, precision=precision)
    split = fit_lm(LMModule(make(), opt, pieces=3, **module_kwargs), "auto", steps=steps, precision=precision)
    return weight_error(split, whole, w0)


