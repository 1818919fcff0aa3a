"""Hugging Face causal LMs through the pipeline: loss and gradients equal the unpipelined model's."""

import lightning as L
import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.adapters.hf_runtime import LogitsNotComputedError

VOCAB = 96


def tiny(arch, seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    return LlamaForCausalLM(LlamaConfig(**common))


def batch(padded, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (5, 12), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[0, :3] = -100  # an ignored prompt
    if padded:
        mask[1, 8:] = 0
        mask[3, 5:] = 0
        labels[mask == 0] = -100
    return ids, mask, labels


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_loss_and_gradients_match_unpipelined(arch, padded, lora):
    model = tiny(arch)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        for n, p in model.named_parameters():  # LoRA B starts at zero; make the test see real gradients
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
    ids, mask, labels = batch(padded)
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    g_ref = grads(model)
    model.zero_grad(set_to_none=True)
    if lora:
        assert g_ref and all("lora_" in n for n in g_ref)
    for m in (1, 2, 3):
        rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=m))
        try:
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            with pytest.raises(LogitsNotComputedError, match="logits_with_loss=True"):
                out.logits  # never silently None
            assert abs(out.loss.item() / ref.loss.item() - 1) <= 1e-6
            out.loss.backward()
            g = grads(model)
            assert g.keys() == g_ref.keys()
            assert max(((g[k] - g_ref[k]).norm() / g_ref[k].norm()).item() for k in g_ref) <= 1e-5
        finally:
            rt.detach()
            model.zero_grad(set_to_none=True)


def test_logits_come_back_without_labels():
    model = tiny("qwen3")
    ids, mask, _ = batch(padded=True)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2))
    try:
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask).logits
        assert torch.allclose(got, ref, atol=1e-6)
        # with grad on and no labels: an ordinary (non-fused) backward through the whole plan
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
        g = grads(model)
    finally:
        rt.detach()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
    g_ref = grads(model)
    assert max(((g[k] - g_ref[k]).norm() / g_ref[k].norm()).item() for k in g_ref) <= 1e-5


@pytest.mark.parametrize("variant", ["loss", "twice", "plus_other"])
def test_fused_scalar_is_exact_for_any_use(variant):
    model = tiny("llama")
    ids, mask, labels = batch(padded=False)

    def objective(loss):
        if variant == "twice":
            return 2 * loss
        if variant == "plus_other":
            return loss + 0.1 * model.model.embed_tokens.weight.pow(2).sum()
        return loss

    objective(model(input_ids=ids, attention_mask=mask, labels=labels).loss).backward()
    g_ref = grads(model)
    model.zero_grad(set_to_none=True)
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2))
    try:
        objective(model(input_ids=ids, attention_mask=mask, labels=labels).loss).backward()
    finally:
        rt.detach()
    g = grads(model)
    assert max(((g[k] - g_ref[k]).norm() / g_ref[k].norm()).item() for k in g_ref) <= 1e-5


def test_dropped_loss_applies_no_gradient():
    model = tiny("qwen3")
    ids, mask, labels = batch(padded=False)
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2))
    try:
        model(input_ids=ids, attention_mask=mask, labels=labels)  # loss dropped: backward never comes
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, labels=labels)
    finally:
        rt.detach()
    assert all(p.grad is None for p in model.parameters())


def test_wrong_label_shape_is_refused():
    model = tiny("qwen3")
    ids, mask, labels = batch(padded=False)
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2))
    try:
        with pytest.raises(ValueError, match=r"labels must have the shape of input_ids \(5, 12\), got \(5, 11\)"):
            model(input_ids=ids, attention_mask=mask, labels=labels[:, :-1])
    finally:
        rt.detach()


class LoraFineTune(L.LightningModule):
    """Written the usual way: from a HF model, peft LoRA, .loss from the model."""

    def __init__(self):
        super().__init__()
        self.model = get_peft_model(tiny("qwen3"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    def training_step(self, b, i):
        loss = self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _lora_fit(strategy, devices):
    torch.manual_seed(0)
    m = LoraFineTune()
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    ids, mask, labels = batch(padded=True, seed=3)
    data = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(5)] * 4
    L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=5, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
        m, DataLoader(data, batch_size=4))
    return m, w0


def test_lora_lightning_module_matches_default_strategy():
    ref, w0 = _lora_fit("auto", 1)
    got, w0b = _lora_fit(RoundPipeStrategy(microbatches=2), 2)
    w_ref = dict(ref.named_parameters())
    moved = 0
    for n, p in got.named_parameters():
        assert torch.equal(w0[n], w0b[n])
        if p.requires_grad:
            moved += 1
            assert ((p - w_ref[n]).norm() / (w_ref[n] - w0[n]).norm()).item() <= 1e-4
        else:
            assert torch.equal(p, w0[n]), f"frozen {n} changed"
    assert moved == 12  # q_proj and v_proj LoRA A/B in 3 layers


def test_overlapping_calls_never_leak_gradients_into_host_weights():
    """A fused run's eager backward may still recompute layers while the next call runs them."""
    model = tiny("qwen3")
    ids, mask, labels = batch(padded=False)
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=3, testing={"jitter_s": 0.002}))
    try:
        for _ in range(15):
            model(input_ids=ids, attention_mask=mask, labels=labels)  # loss dropped, backward still running
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
    finally:
        rt.detach()
    assert all(p.grad is None for p in model.parameters())
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # every swap was undone
