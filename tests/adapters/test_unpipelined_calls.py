"""Training calls that run unpipelined (peft's prefix tuning, use_cache=True) say so, once, and stay exact."""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch
from peft import PrefixTuningConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset

from _family_configs import family_batch, tiny_model
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.adapters.unpipelined_calls import UnpipelinedCallWarning


class CausalLMModule(L.LightningModule):
    def __init__(self, model, optimizer, **call):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self.call = call

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=labels, **self.call).loss

    def configure_optimizers(self):
        return self.optimizer([p for p in self.parameters() if p.requires_grad])


def prefix_tuned():
    model = get_peft_model(tiny_model("llama"), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    with torch.no_grad():  # the prefix starts random, so its gradient is not trivial
        for param in model.parameters():
            if param.requires_grad:
                param.normal_(0.0, 0.3)
    return model


def fit_both(base, optimizer, **call):
    """(default-strategy weights, RoundPipe weights, the UnpipelinedCallWarnings RoundPipe raised) after 3 steps."""
    data = DataLoader(TensorDataset(*family_batch("right")), batch_size=6)
    ends, said = [], []
    for strategy, devices in (("auto", 1), (RoundPipeStrategy(microbatches=3), 2)):
        module = CausalLMModule(copy.deepcopy(base), optimizer, **call)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False).fit(module, data)
        said.append([w for w in caught if issubclass(w.category, UnpipelinedCallWarning)])
        ends.append({n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad})
    assert not said[0]  # the default strategy never says it
    return ends[0], ends[1], said[1]


OPTIMIZERS = [lambda p: torch.optim.SGD(p, lr=0.2), lambda p: torch.optim.AdamW(p, lr=0.01)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=["sgd", "adamw"])
def test_prefix_tuning_warns_once_and_trains_like_the_default_strategy(optimizer):
    base = prefix_tuned()
    start = {n: p.detach().clone() for n, p in base.named_parameters() if p.requires_grad}
    reference, pipelined, said = fit_both(base, optimizer)
    assert len(said) == 1, [str(w.message) for w in said]
    message = str(said[0].message)
    assert "runs unpipelined" in message and "prefix tuning" in message and "such as LoRA" in message
    for name, want in reference.items():
        update = want - start[name]
        assert update.norm() > 0, name
        assert (pipelined[name] - want).norm() / update.norm() <= 1e-4, name


@pytest.mark.timeout(90)
def test_use_cache_in_training_warns_once_naming_the_fix():
    base = tiny_model("llama")
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    reference, pipelined, said = fit_both(base, OPTIMIZERS[0], use_cache=True)
    assert len(said) == 1
    assert "use_cache=True" in str(said[0].message) and "Pass use_cache=False" in str(said[0].message)
    for name, want in reference.items():
        update = want - start[name]
        assert (pipelined[name] - want).norm() / update.norm() <= 1e-4, name
