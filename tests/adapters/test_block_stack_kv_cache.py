"""A Hugging Face model's decoder layers pipelined as a block stack (``module="model.model.layers"``).

The model's own loop hands every layer the same key/value cache when ``use_cache`` is on, and each
layer appends to it: microbatches run one after another through a shared cache would attend to
each other's keys (before this check it ran, silently 0.2% off on a sequence classifier's loss).
So a cache argument is refused before anything runs; with ``use_cache=False`` the stack is exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.adapters.block_chain import BlockChainError

pytestmark = pytest.mark.timeout(120)

CONFIG = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=8, pad_token_id=0, num_labels=3)


def pair(model_class):
    cfg = AutoConfig.for_model("qwen3", **CONFIG)
    torch.manual_seed(0)
    reference = model_class.from_config(cfg)
    pipelined = model_class.from_config(cfg)
    pipelined.load_state_dict(reference.state_dict())
    return reference, pipelined


def batch():
    torch.manual_seed(1)
    return torch.randint(3, 64, (4, 12)), torch.tensor([0, 1, 2, 1])


@pytest.mark.parametrize("model_class", [AutoModelForSequenceClassification, AutoModelForCausalLM])
def test_a_shared_key_value_cache_is_refused_before_anything_runs(model_class):
    _, model = pair(model_class)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    runtime = RoundPipeRuntime.attach(model.model.layers, num_workers=2, path="model.layers",
                                      options=RuntimeOptions(microbatches=2))
    try:
        ids, _ = batch()
        with pytest.raises(BlockChainError, match=r"key/value cache \(DynamicCache\).*use_cache=False"):
            model(input_ids=ids, use_cache=True)
    finally:
        runtime.detach()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("microbatches", [2, 4])
def test_without_a_cache_the_classifier_layers_pipeline_exactly(microbatches):
    reference, model = pair(AutoModelForSequenceClassification)
    ids, labels = batch()
    ref_loss = reference(input_ids=ids, labels=labels, use_cache=False).loss
    ref_loss.backward()
    runtime = RoundPipeRuntime.attach(model.model.layers, num_workers=2, path="model.layers",
                                      options=RuntimeOptions(microbatches=microbatches))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            loss.backward()
            runtime.end_backward()
    finally:
        runtime.detach()
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        g_ref = ref_params[name].grad
        assert p.grad is not None, name
        assert float((p.grad - g_ref).norm() / g_ref.norm().clamp_min(1e-30)) <= 1e-5, name
