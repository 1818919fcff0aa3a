"""MoE: HF's load-balancing aux loss over the whole batch, from statistics carried across microbatches."""

from __future__ import annotations

import pytest
import torch

from _family_configs import AUX_LOSS_FAMILIES, family_batch, tiny_model
from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.adapters.hf_causal_lm import CausalLMLayers
from lightning_roundpipe.adapters.hf_moe import aux_loss, find_router, per_microbatch_aux_loss


def router_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and ".gate." in f".{n}."
            or (p.grad is not None and "router" in n)}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_aux_loss_and_router_gradients_equal_hf_for_the_whole_batch(family):
    model = tiny_model(family)
    ids, mask, labels = family_batch("right")
    ref = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    plain = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=False)
    assert ref.loss.item() - plain.loss.item() == pytest.approx(0.7 * ref.aux_loss.item(), rel=1e-5)  # coefficient on
    ref.loss.backward()
    g_ref = router_grads(model)
    assert g_ref
    model.zero_grad(set_to_none=True)
    runtime = RoundPipeRuntime.attach(model, "cpu", 3, RuntimeOptions(microbatches=3))
    try:
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        assert abs(out.aux_loss.item() / ref.aux_loss.item() - 1) <= 1e-6
        assert abs(out.loss.item() / ref.loss.item() - 1) <= 1e-6
        out.loss.backward()
        got = router_grads(model)
        assert got.keys() == g_ref.keys()
        for name in g_ref:
            assert (got[name] - g_ref[name]).norm() / g_ref[name].norm() <= 1e-5, name
        model.zero_grad(set_to_none=True)
        without_labels = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
        assert without_labels.loss is None
        assert abs(without_labels.aux_loss.item() / ref.aux_loss.item() - 1) <= 1e-6
        # output_router_logits off (the config default): no aux term, HF's plain loss
        off = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert off.aux_loss is None
        assert abs(off.loss.item() / plain.loss.item() - 1) <= 1e-6
    finally:
        runtime.detach()


def test_per_microbatch_aux_loss_would_be_wrong():
    """The naive sum/mean over microbatches differs from HF's; the carried totals do not."""
    model = tiny_model("mixtral").eval()
    ids, mask, labels = family_batch("left")
    ref = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss.item()
    layers = CausalLMLayers.from_model(model)
    rows = []
    for part in zip(ids.tensor_split(3), mask.tensor_split(3)):
        out = layers.run({"input_ids": part[0], "attention_mask": part[1], "router_stats": True, "outputs": "logits"})
        rows.append(out)
    stack = {k: torch.cat([r[k] for r in rows]) for k in ("moe_counts", "moe_probs", "moe_rows")}
    exact = aux_loss(stack["moe_counts"].sum(0), stack["moe_probs"].sum(0), stack["moe_rows"].sum(), 4).item()
    naive = per_microbatch_aux_loss(stack["moe_counts"], stack["moe_probs"], stack["moe_rows"], 4).item()
    assert abs(exact / ref - 1) <= 1e-6
    assert abs(naive / ref - 1) > 1e-3


def test_router_is_found_from_the_models_own_recorders():
    for family in AUX_LOSS_FAMILIES:
        router = find_router(tiny_model(family))
        assert router is not None and router.num_experts == 4 and router.top_k == 2 and router.coefficient == 0.7
    assert find_router(tiny_model("llama")) is None


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_lora_on_expert_tensors_and_attention_with_the_aux_loss(family):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(family), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                          target_parameters=["mlp.experts.gate_up_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)
    ids, mask, labels = family_batch("left")
    ref = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    ref.loss.backward()
    g_ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any("experts.lora_A" in n for n in g_ref) and any("q_proj.lora_A" in n for n in g_ref)
    model.zero_grad(set_to_none=True)
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=3))
    try:
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        assert abs(out.loss.item() / ref.loss.item() - 1) <= 1e-6
        out.loss.backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == g_ref.keys()
        for name in g_ref:
            assert (got[name] - g_ref[name]).norm() / g_ref[name].norm() <= 1e-5, name
    finally:
        runtime.detach()
