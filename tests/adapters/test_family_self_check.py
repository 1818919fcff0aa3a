"""The self-check of unverified families (allow_unverified=True): exact, or refused naming the family and the part.

JetMoE adds its aux loss with ``aux_loss_coef`` (not ``router_aux_loss_coef``): the adapter reads
the coefficient from the family's own forward and the self-check compares the loss with its aux
term, so training under the Trainer equals Lightning's default strategy. Families whose forward
the adapter cannot reproduce are refused on the first call, before any weight changes, with the
family and the failing part in the message.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from _family_configs import family_batch
from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.adapters.hf_causal_lm import CausalLMLayers, UnsupportedModelError
from lightning_roundpipe.adapters.hf_moe import aux_coefficient, find_router

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)

JETMOE = dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=8, aux_loss_coef=0.7, output_router_logits=True)

REFUSED = {
    # model_type: (config values beyond TINY, the part the refusal names)
    "llama4_text": (dict(num_local_experts=2, interleave_moe_layer_step=1, intermediate_size_mlp=32),
                    r"pipeline layer 0 \(CausalLMPrefix"),
    "deepseek_v2": (dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                         first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                         qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=2), r"pipeline layer 0 \(CausalLMPrefix"),
    "gemma4_text": (dict(), r"pipeline layer 1 \(decoder layer 0, Gemma4TextDecoderLayer\)"),
    "gemma3n_text": (dict(vocab_size_per_layer_input=64, hidden_size_per_layer_input=4, laurel_rank=4,
                          layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.95, 0.0],
                          num_kv_shared_layers=0, sliding_window=4),
                     r"pipeline layer 1 \(decoder layer 0, Gemma3nTextDecoderLayer\)"),
}
"""Unverified families that crashed inside the old check (issue 20, item 8)."""


def tiny(model_type: str, **extra):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no {model_type!r} model in this version")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **extra}))


def test_jetmoe_coefficient_is_read_from_its_forward():
    model = tiny("jetmoe", **JETMOE)
    assert aux_coefficient(model) == 0.7  # self.aux_loss_coef
    assert not hasattr(model, "router_aux_loss_coef")
    assert find_router(model).coefficient == 0.7


@pytest.mark.timeout(60)
def test_jetmoe_loss_with_aux_equals_its_own_forward():
    model = tiny("jetmoe", **JETMOE)
    ids, mask, labels = family_batch("right")
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(allow_unverified=True))
    try:
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    finally:
        runtime.detach()
    assert abs(out.aux_loss.item() / ref.aux_loss.item() - 1) <= 1e-6
    assert abs(out.loss.item() / ref.loss.item() - 1) <= 1e-6


class JetMoeModule(L.LightningModule):
    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True).loss

    def configure_optimizers(self):
        return self.optimizer(self.parameters())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", [lambda p: torch.optim.SGD(p, lr=0.2), lambda p: torch.optim.AdamW(p, lr=0.01)],
                         ids=["sgd", "adamw"])
def test_jetmoe_with_router_logits_trains_like_the_default_strategy(optimizer):
    base = tiny("jetmoe", **JETMOE)
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    data = DataLoader(TensorDataset(*family_batch("left")), batch_size=6)
    ends = []
    for strategy, devices in (("auto", 1), (RoundPipeStrategy(allow_unverified=True, microbatches=3), 2)):
        module = JetMoeModule(copy.deepcopy(base), optimizer)
        L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=3, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, data)
        ends.append({n: p.detach().clone() for n, p in module.model.named_parameters()})
    reference, pipelined = ends
    for name, want in reference.items():
        update = want - start[name]
        if update.norm() == 0:
            continue
        assert (pipelined[name] - want).norm() / update.norm() <= 1e-4, name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_unverified_family_that_crashes_is_refused_naming_family_and_part(model_type):
    extra, part = REFUSED[model_type]
    model = tiny(model_type, **extra)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, mask, labels = family_batch("right")
    with pytest.raises(UnsupportedModelError) as err:
        runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(allow_unverified=True))
        try:
            model(input_ids=ids, attention_mask=mask, labels=labels)
        finally:
            runtime.detach()
    message = str(err.value)
    assert f"(model_type={model_type!r}) is not a verified family, and the self-check of allow_unverified=True failed " \
           "in " in message
    assert __import__("re").search(part, message), message
    assert "Train it with another strategy" in message and "No weight was changed" in message
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert "forward" not in vars(model)  # the model is as it was


def test_a_failure_while_building_the_layers_names_the_adapter_function():
    model = tiny("deepseek_v2", n_routed_experts=4, moe_intermediate_size=16, kv_lora_rank=8, q_lora_rank=8,
                 qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=2,
                 num_experts_per_tok=None)
    with pytest.raises(UnsupportedModelError, match=r"model_type='deepseek_v2'.*failed in building its pipeline "
                                                    r"layers, in find_router \(hf_moe\.py\): ValueError"):
        RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(allow_unverified=True))
    with pytest.raises(ValueError, match="number of experts"):  # verified or not, the adapter's own words
        CausalLMLayers.from_model(model, allow_unverified=True)


def test_the_self_check_compares_the_loss_with_its_aux_term():
    """Had the coefficient been missed (the old reading of router_aux_loss_coef), the check would refuse."""
    import dataclasses

    from lightning_roundpipe.adapters.hf_self_check import check_first_microbatch

    model = tiny("jetmoe", **JETMOE)
    adapter = CausalLMLayers.from_model(model, allow_unverified=True)
    ids, mask, labels = family_batch("right")
    first = {"input_ids": ids[:2], "attention_mask": mask[:2]}
    found = check_first_microbatch(model, adapter, first, labels[:2])
    assert max(found.values()) <= 1e-6 and "loss (with the aux term the family adds)" in found
    adapter.router = dataclasses.replace(adapter.router, coefficient=None)
    with pytest.raises(UnsupportedModelError, match=r"model_type='jetmoe'.*failed in the parity check of the first "
                                                    r"microbatch: the pipelined loss \(with the aux term the family "
                                                    r"adds\) differs .* by \d.*the adapter adds no aux term"):
        check_first_microbatch(model, adapter, first, None)  # no labels: the inputs serve as labels
