"""Unverified families, logits with the loss, generate(), and Hugging Face gradient checkpointing."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from _family_configs import family_batch, tiny_model
from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.adapters.hf_causal_lm import UnsupportedModelError
from lightning_roundpipe.adapters.hf_runtime import LogitsNotComputedError

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def unverified(model_type, **extra):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **extra))


def test_unverified_family_is_refused_naming_the_real_option():
    with pytest.raises(UnsupportedModelError, match=r"RoundPipeStrategy\(allow_unverified=True\)") as err:
        RoundPipeRuntime.attach(unverified("arcee"), "cpu", 2)
    assert "RuntimeOptions(allow_unverified=True)" in str(err.value)
    assert RoundPipeStrategy(allow_unverified=True).options.allow_unverified  # the option exists on the strategy
    assert RoundPipeStrategy(logits_with_loss=True).options.logits_with_loss


def test_unverified_family_runs_after_a_passing_parity_check():
    model = unverified("arcee")
    ids, mask, labels = family_batch("right")
    ref = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(allow_unverified=True))
    try:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        assert abs(loss.item() / ref.item() - 1) <= 1e-6
    finally:
        runtime.detach()


def test_unverified_family_that_differs_is_refused_with_the_measured_difference():
    model = unverified("granitemoe", embedding_multiplier=3.0, logits_scaling=5.0, num_local_experts=4,
                       num_experts_per_tok=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, mask, labels = family_batch("right")
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(allow_unverified=True))
    try:
        with pytest.raises(UnsupportedModelError, match=r"parity check.*differs .* by \d\.\d+.*No weight was changed"):
            model(input_ids=ids, attention_mask=mask, labels=labels)
    finally:
        runtime.detach()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_known_misfit_family_says_why():
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("bloom", vocab_size=64, hidden_size=16, n_layer=2,
                                                                  n_head=2))
    with pytest.raises(UnsupportedModelError, match=r"model_type='bloom'.*ALiBi"):
        RoundPipeRuntime.attach(model, "cpu", 2)
    falcon = AutoModelForCausalLM.from_config(AutoConfig.for_model("falcon", vocab_size=64, hidden_size=16,
                                                                   num_hidden_layers=2, num_attention_heads=2, alibi=True))
    with pytest.raises(UnsupportedModelError, match=r"config.alibi=True: ALiBi"):
        RoundPipeRuntime.attach(falcon, "cpu", 2)


def test_logits_with_labels_raise_on_access_or_come_back_with_the_option():
    model = tiny_model("gemma2")
    ids, mask, labels = family_batch("left")
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    runtime = RoundPipeRuntime.attach(model, "cpu", 2)
    try:
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        with pytest.raises(LogitsNotComputedError, match=r"logits_with_loss=True"):
            out.logits
        assert abs(out.loss.item() / ref.loss.item() - 1) <= 1e-6
    finally:
        runtime.detach()
    ref.loss.backward()
    g_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(logits_with_loss=True))
    try:
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert (out.logits - ref.logits).norm() / ref.logits.norm() <= 1e-6
        assert abs(out.loss.item() / ref.loss.item() - 1) <= 1e-6
        out.loss.backward()
        for name, param in model.named_parameters():
            assert (param.grad - g_ref[name]).norm() / g_ref[name].norm() <= 1e-5, name
    finally:
        runtime.detach()


class CausalLMModule(L.LightningModule):
    """A causal LM trained on (ids, mask, labels) batches with SGD at ``lr``."""

    def __init__(self, model, lr=0.5):
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_is_subsumed_exactly(reentrant):
    """Reentrant HF checkpointing inside a stage used to leave a whole decoder layer without gradient."""
    from torch.utils.data import DataLoader, TensorDataset

    base = tiny_model("llama")
    # transformers 5's name for gradient_checkpointing_enable (deprecated); it sets the same layer flags
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    data = DataLoader(TensorDataset(*family_batch("right")), batch_size=6)
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    updates = []
    for strategy, devices in (("auto", 1), (RoundPipeStrategy(microbatches=3), 2)):
        module = CausalLMModule(copy.deepcopy(base))
        L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=1, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, data)
        updates.append({n: p.detach() - start[n] for n, p in module.model.named_parameters()})
        layers = [m for m in module.model.modules() if type(m).__name__.endswith("DecoderLayer")]
        assert layers and all(m.gradient_checkpointing for m in layers)  # the user's setting is left as it was
    reference, pipelined = updates
    for name, update in reference.items():
        assert update.norm() > 0, name
        assert pipelined[name].norm() > 0, f"{name} got no gradient"  # no parameter silently untrained
        assert (pipelined[name] - update).norm() / update.norm() <= 1e-4, name


class GenerateInValidation(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_model("qwen3")
        self.generated = []

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss

    def validation_step(self, batch, batch_idx):
        ids = batch[0][:1, :4]
        self.generated.append(self.model.generate(ids, max_new_tokens=3, do_sample=False))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_generate_inside_validation_step_during_fit_matches_the_default_strategy():
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(*family_batch("right")), batch_size=6)
    results = []
    for strategy in ("auto", RoundPipeStrategy()):
        module = GenerateInValidation()
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2 if strategy != "auto" else 1,
                            max_epochs=2, limit_val_batches=1, val_check_interval=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0)
        trainer.fit(module, train_dataloaders=data, val_dataloaders=data)
        results.append(module.generated)
    assert len(results[0]) == len(results[1]) == 2
    for a, b in zip(*results):
        assert torch.equal(a, b)
