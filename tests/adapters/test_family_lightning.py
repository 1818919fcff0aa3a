"""A representative subset of families under the Lightning Trainer: RoundPipe against the default strategy.

Each family's special path (soft-capping, multipliers, logit scale with a tied head, MoE aux
loss, LoRA) trains 3 SGD steps under ``strategy="roundpipe"`` and under Lightning's default
strategy; the weights agree within 1e-4 of the update. Every family's 3-step weights against the
plain single-device loop are in ``test_family_parity.py``.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset

from _family_configs import family_batch, lora_targets, tiny_model
from lightning_roundpipe import RoundPipeStrategy


class FamilyModule(L.LightningModule):
    def __init__(self, model, aux):
        super().__init__()
        self.model = model
        self.aux = aux

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        kwargs = {"output_router_logits": True} if self.aux else {}
        return self.model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def fit(model, strategy, devices, aux):
    module = FamilyModule(model, aux)
    data = DataLoader(TensorDataset(*family_batch("left")), batch_size=6)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family, lora, aux", [("gemma2", False, False), ("granite", False, False),
                                               ("cohere", True, False), ("mixtral", False, True),
                                               ("qwen3_moe", True, True)])
def test_family_trains_like_the_default_strategy(family, lora, aux):
    model = tiny_model(family)
    if lora:
        model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=lora_targets(family)))
        for module in model.modules():  # no dropout: both runs must see the same function
            if hasattr(module, "lora_dropout"):
                for drop in module.lora_dropout.values():
                    drop.p = 0.0
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.05)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    reference = fit(copy.deepcopy(model), "auto", 1, aux)
    pipelined = fit(model, RoundPipeStrategy(microbatches=3), 2, aux)
    for name, ref in reference.items():
        update = (ref - start[name]).norm()
        assert update > 0, name
        assert (pipelined[name] - ref).norm() / update <= 1e-4, name
