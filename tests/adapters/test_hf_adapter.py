"""Hugging Face causal LMs as pipeline layers: exact parity with the unpipelined model.

Tiny random fp32 models (hidden 32, 2 layers, vocab 128). Qwen2 is built with one full and one
sliding-window layer and tied embeddings, Mistral with a short sliding window, so both mask kinds
and a shared parameter are exercised.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from lightning_roundpipe.adapters.hf_causal_lm import (  # noqa: E402
    CausalLMLayers,
    UnsupportedModelError,
    count_loss_tokens,
)
from lightning_roundpipe.adapters.input_errors import UnsupportedInputError  # noqa: E402

VOCAB, BATCH, SEQ = 128, 6, 12
COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)
ARCHS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "qwen2": lambda: transformers.Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1, tie_word_embeddings=True
    ),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=8),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=5),
}
MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def build_model(arch: str, attn: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = ARCHS[arch]()
    config._attn_implementation = attn
    model = getattr(transformers, MODEL_CLASSES[arch])(config)
    model.train()  # dropout is 0 in these configs, so train mode is deterministic
    return model


def make_batch(padded: bool, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    if padded:
        attention_mask[1, 8:] = 0  # right padding
        attention_mask[4, :3] = 0  # left padding
        attention_mask[5, 10:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def split_batch(batch: dict, parts: int) -> list[dict]:
    size = BATCH // parts
    return [{k: v[i * size : (i + 1) * size] for k, v in batch.items()} for i in range(parts)]


def pipelined_loss(layers: CausalLMLayers, batch: dict, parts: int) -> torch.Tensor:
    """What the engine computes: sum of per-microbatch loss sums / token count of the batch."""
    total = sum(layers.run(mb)["loss_sum"] for mb in split_batch(batch, parts))
    return total / count_loss_tokens(batch["labels"])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def assert_grads_match(got, ref, names, tol=1e-5):
    for name, g, g_ref in zip(names, got, ref):
        assert g is not None, name
        assert rel_err(g, g_ref) < tol, (name, rel_err(g, g_ref))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("padded", [False, True])
def test_loss_logits_and_grads_match_model(arch, attn, padded):
    model = build_model(arch, attn)
    batch = make_batch(padded)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])

    ref = model(**batch)
    ref_grads = torch.autograd.grad(ref.loss, params)

    layers = CausalLMLayers.from_model(model)
    assert len(layers.layers) == 2 + model.config.num_hidden_layers
    for parts in (1, 2, 3):
        loss = pipelined_loss(layers, batch, parts)
        assert abs(loss.item() - ref.loss.item()) <= 1e-6 * abs(ref.loss.item()), parts
        assert_grads_match(torch.autograd.grad(loss, params), ref_grads, names)

    layers.set_postfix_mode("logits")
    for parts in (1, 3):
        logits = torch.cat([layers.run(mb)["logits"] for mb in split_batch(batch, parts)])
        assert logits.dtype == ref.logits.dtype
        torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefix_carry_matches_model_internals(arch):
    model = build_model(arch, "sdpa")
    layers = CausalLMLayers.from_model(model)
    unpadded = layers.prefix({"input_ids": make_batch(False)["input_ids"]})
    # sdpa without padding needs no dense mask: causal flag only (same as the model's helper).
    assert unpadded["mask"] is None
    assert unpadded["position_ids"].tolist() == [list(range(SEQ))]
    assert "labels" not in unpadded
    assert unpadded["hidden"].shape == (BATCH, SEQ, 32)
    padded = layers.prefix(make_batch(True))
    assert padded["mask"].shape == (BATCH, 1, SEQ, SEQ) and padded["mask"].dtype == torch.bool
    assert not padded["mask"][1, 0, 9, 8].item() and padded["mask"][1, 0, 7, 0].item()
    if arch == "qwen2":  # layer 1 is sliding (window 4): query 9 may not see key 5
        assert padded["sliding_mask"][0, 0, 9, 6].item() and not padded["sliding_mask"][0, 0, 9, 5].item()
        assert [step.mask_key for step in layers.layers[1:-1]] == ["mask", "sliding_mask"]
    else:
        assert "sliding_mask" not in padded


def test_explicit_position_ids_are_used():
    model = build_model("llama", "sdpa")
    batch = make_batch(False)
    batch["position_ids"] = torch.arange(SEQ).flip(0).unsqueeze(0).expand(BATCH, -1).contiguous() + 3
    ref = model(**batch).loss
    loss = pipelined_loss(CausalLMLayers.from_model(model), batch, parts=2)
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_functional_call_with_cloned_params_is_identical(arch):
    """The engine's calling convention: each layer run with its own copies of params/buffers."""
    model = build_model(arch, "sdpa")
    batch = make_batch(True)
    layers = CausalLMLayers.from_model(model)
    names, params = zip(*model.named_parameters())
    plain_loss = pipelined_loss(layers, batch, parts=2)
    plain_grads = torch.autograd.grad(plain_loss, params)

    clones = []
    for layer in layers.layers:
        tensors = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
        tensors.update({n: b.clone() for n, b in layer.named_buffers()})
        clones.append(tensors)
    total = 0
    for mb in split_batch(batch, 2):
        carry = mb
        for layer, tensors in zip(layers.layers, clones):
            carry = torch.func.functional_call(layer, tensors, (carry,))
        total = total + carry["loss_sum"]
    loss = total / count_loss_tokens(batch["labels"])
    assert torch.equal(loss, plain_loss)

    # Map each model parameter to its clone(s); tied ones appear in two layers and add up.
    by_identity = {}
    for layer, tensors in zip(layers.layers, clones):
        for name, param in layer.named_parameters():
            by_identity.setdefault(id(param), []).append(tensors[name])
    flat = [t for group in by_identity.values() for t in group]
    flat_grads = dict(zip(map(id, flat), torch.autograd.grad(loss, flat)))
    for name, param, g_ref in zip(names, params, plain_grads):
        g = sum(flat_grads[id(t)] for t in by_identity[id(param)])
        torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-7, msg=name)

    tied = layers.shared_parameters()
    if arch == "qwen2":
        assert tied == [[(0, "embed_tokens.weight"), (len(layers.layers) - 1, "lm_head.weight")]]
    else:
        assert tied == []


def test_no_grad_forward_then_recompute_under_grad():
    model = build_model("llama", "sdpa")
    batch = make_batch(True)
    layers = CausalLMLayers.from_model(model)
    with torch.no_grad():
        cached = layers.run(batch)["loss_sum"]
    assert not cached.requires_grad
    recomputed = layers.run(batch)["loss_sum"]
    assert recomputed.requires_grad and torch.equal(cached, recomputed)


def test_loss_mode_never_materialises_full_logits():
    model = build_model("llama", "sdpa")
    layers = CausalLMLayers.from_model(model, loss_chunk_size=5)
    assert layers.postfix.uses_chunked_loss
    carry = layers.run(make_batch(False))
    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and VOCAB in t.shape:
                    seen.append(tuple(t.shape))
            return out

    prefix_to_postfix = layers.prefix(make_batch(False))
    for step in layers.layers[1:-1]:
        prefix_to_postfix = step(prefix_to_postfix)
    with Recorder():
        out = layers.postfix(prefix_to_postfix)
        out["loss_sum"].backward()
    assert torch.equal(out["loss_sum"], carry["loss_sum"])
    weight_shapes = {(VOCAB, 32), (32, VOCAB)}  # lm_head weight, its transpose and its gradient
    logits_shapes = {shape for shape in seen if shape not in weight_shapes}
    # 72 tokens in chunks of 5 (last one 2), and their transposes: never (BATCH, SEQ, VOCAB).
    assert logits_shapes == {(5, VOCAB), (VOCAB, 5), (2, VOCAB), (VOCAB, 2)}


def test_postfix_modes_and_errors():
    model = build_model("llama", "sdpa")
    layers = CausalLMLayers.from_model(model, postfix_mode="loss")
    batch = make_batch(False)
    without_labels = {k: v for k, v in batch.items() if k != "labels"}
    with pytest.raises(UnsupportedInputError, match="^CausalLMPostfix in loss mode needs 'labels' in the microbatch$"):
        layers.run(without_labels)
    layers.set_postfix_mode("auto")
    assert set(layers.run(without_labels)) == {"logits"}
    assert set(layers.run(batch)) == {"loss_sum"}
    with pytest.raises(ValueError, match="'auto', 'logits', 'loss', 'loss_and_logits' or 'loss_and_stats'") as mode:
        layers.set_postfix_mode("both")
    assert type(mode.value) is ValueError  # a programming error about internal modes, not the user's input
    with pytest.raises(UnsupportedInputError, match=r"^CausalLMPrefix got unsupported input keys \['token_type_ids'\]; "
                                                     r"a microbatch may hold only \["):
        layers.run({**batch, "token_type_ids": torch.zeros_like(batch["input_ids"])})
    with pytest.raises(UnsupportedInputError, match=r"^CausalLMPrefix needs 'input_ids' of shape \[batch, seq\]; got \(72,\)$"):
        layers.run({**batch, "input_ids": batch["input_ids"].reshape(-1)})
    with pytest.raises(UnsupportedInputError, match="^router statistics were asked for, but the model has no MoE router$"):
        layers.run({**batch, "router_stats": True})
    assert issubclass(UnsupportedInputError, ValueError)  # existing `except ValueError` code still catches them


def test_count_loss_tokens_is_hf_denominator():
    labels = torch.tensor([[5, 6, -100, 7], [-100, -100, 8, 9]])
    assert count_loss_tokens(labels) == 4  # shifted: [6, -100, 7], [-100, 8, 9]
    assert count_loss_tokens(labels, ignore_index=7) == 5  # a different ignore index counts the -100s


def test_peft_lora_model_only_lora_params_get_grads():
    peft = pytest.importorskip("peft")
    base = build_model("llama", "sdpa")
    # init_lora_weights=False: random A and B, so LoRA changes the output and both get gradients.
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    batch = make_batch(True)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    assert names and all("lora_" in n for n in names)
    ref = model(**batch).loss
    ref_grads = torch.autograd.grad(ref, params)

    layers = CausalLMLayers.from_model(model)
    assert layers.model is base
    loss = pipelined_loss(layers, batch, parts=3)
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    loss.backward()
    for name, param in model.named_parameters():
        assert (param.grad is not None) == ("lora_" in name), name
    assert_grads_match([p.grad for p in params], ref_grads, names)


def test_model_is_unchanged_by_building_and_running_layers():
    model = build_model("qwen2", "sdpa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config_before = model.config.to_dict()
    loss_function, attrs = model.loss_function, set(vars(model))
    layers = CausalLMLayers.from_model(model, loss_chunk_size=7)
    pipelined_loss(layers, make_batch(True), parts=2).backward()
    layers.set_postfix_mode("logits")
    layers.run(make_batch(False))
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert model.config.to_dict() == config_before
    assert model.loss_function == loss_function and set(vars(model)) == attrs
    # The layers hold the model's own modules, not copies.
    assert layers.layers[1].decoder_layer is model.model.layers[0]
    assert layers.postfix.lm_head is model.lm_head


def test_unsupported_model_names_missing_attribute():
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB))
    with pytest.raises(UnsupportedModelError, match=r"BloomForCausalLM \(model_type='bloom'\) cannot be pipelined") as info:
        CausalLMLayers.from_model(bloom)
    assert isinstance(info.value, ValueError)
    assert "ALiBi" in str(info.value) and "nn.Sequential" in str(info.value)


class _FakeCausalLM(nn.Module):
    """Has the expected attributes up to a configurable point."""

    def __init__(self, model_type="llama", with_rotary=True):
        super().__init__()
        self.config = SimpleNamespace(model_type=model_type, num_hidden_layers=1)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(4, 2)
        self.model.layers = nn.ModuleList([nn.Identity()])
        self.model.norm = nn.Identity()
        if with_rotary:
            self.model.rotary_emb = nn.Identity()
        self.lm_head = nn.Linear(2, 4, bias=False)


def test_missing_nested_attribute_is_named():
    with pytest.raises(UnsupportedModelError, match=r"_FakeCausalLM has no attribute 'model\.model\.rotary_emb'"):
        CausalLMLayers.from_model(_FakeCausalLM(with_rotary=False))


def test_unverified_model_type_needs_opt_in():
    with pytest.raises(UnsupportedModelError, match=r"model_type='arcee'.*RoundPipeStrategy\(allow_unverified=True\)"):
        CausalLMLayers.from_model(_FakeCausalLM(model_type="arcee"))
    layers = CausalLMLayers.from_model(_FakeCausalLM(model_type="arcee"), allow_unverified=True)
    assert len(layers.layers) == 3 and not layers.verified
    assert CausalLMLayers.from_model(_FakeCausalLM(model_type="gemma")).verified


def test_layers_run_concurrently_on_threads():
    """Different layers on different threads at once (as workers do) give the sequential result."""
    import queue
    import threading

    model = build_model("qwen2", "eager")
    layers = CausalLMLayers.from_model(model)
    microbatches = split_batch(make_batch(True), 3)
    expected = [layers.run(mb)["loss_sum"] for mb in microbatches]

    # One thread per layer, linked by queues: layer k works on microbatch i while layer k+1
    # works on microbatch i-1.
    links = [queue.Queue() for _ in range(len(layers.layers) + 1)]
    errors = []

    def worker(index, layer):
        try:
            for _ in microbatches:
                slot, carry = links[index].get(timeout=30)
                tensors = {n: p for n, p in layer.named_parameters()}
                tensors.update(dict(layer.named_buffers()))
                links[index + 1].put((slot, torch.func.functional_call(layer, tensors, (carry,))))
        except Exception as error:  # surfaced by the assertion below, without waiting
            errors.append(error)
            for _ in microbatches:
                links[-1].put((None, error))

    threads = [threading.Thread(target=worker, args=(i, layer)) for i, layer in enumerate(layers.layers)]
    for thread in threads:
        thread.start()
    for slot, mb in enumerate(microbatches):
        links[0].put((slot, mb))
    results = dict(links[-1].get(timeout=30) for _ in microbatches)
    assert errors == []
    for thread in threads:
        thread.join(timeout=30)
    for slot, loss in enumerate(expected):
        assert torch.equal(results[slot]["loss_sum"], loss)
