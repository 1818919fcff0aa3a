"""Messages for models the adapter does not pipeline, and for calls that bypass the pipeline (issue 43, item 14).

Tiny models are built from transformers' config classes (no download)."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import transformers as tf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _family_configs import tiny_model
from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.adapters.input_errors import UnsupportedInputError
from lightning_roundpipe.adapters.target import PipelineTargetError, find_target
from lightning_roundpipe.adapters.unpipelined_calls import UnpipelinedCallWarning

warnings.filterwarnings("ignore", ".*falling back to its reference PyTorch implementation.*")
warnings.filterwarnings("ignore", ".*use_mamba_kernels.*")

LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)


def tiny(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mamba":
        return tf.MambaForCausalLM(tf.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=4,
                                                  expand=2, conv_kernel=2))
    if kind == "jamba":
        return tf.JambaForCausalLM(tf.JambaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1,
            attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4))
    if kind == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                                         num_heads=2))
    if kind == "llava":
        return tf.LlavaForConditionalGeneration(tf.LlavaConfig(
            text_config=tf.LlamaConfig(**LLAMA),
            vision_config=tf.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=8, patch_size=4),
            image_token_index=63))
    raise ValueError(kind)


class Holder(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model


COMMON = ("which RoundPipe's causal-LM adapter does not support", "the verified families cohere,",
          "llama", "allow_unverified=True would not help")


@pytest.mark.parametrize("kind, what, module_help", [
    ("mamba", "a state-space (SSM) model", "RoundPipeStrategy(module='model.backbone.layers')"),
    ("jamba", "a hybrid of state-space (SSM) and attention layers", "module= would not help either"),
    ("t5", "an encoder-decoder model", "module= would not help either: its blocks hand values"),
    ("llava", "a vision-language model", "RoundPipeStrategy(module='model.model.language_model.layers')"),
])
def test_unsupported_kinds_are_named_with_what_is_supported_and_what_helps(kind, what, module_help):
    with pytest.raises(PipelineTargetError) as err:
        find_target(Holder(tiny(kind)))
    text = str(err.value)
    assert text.startswith(f"Holder.model is a {type(tiny(kind)).__name__} (model_type='{kind}'): {what}")
    assert all(part in text for part in COMMON) and module_help in text
    assert "has no attribute" not in text
    if kind == "t5":
        assert "module='" not in text  # no suggestion that would then be refused


def test_the_suggested_module_for_mamba_pipelines_exactly():
    model, reference = tiny("mamba"), tiny("mamba")
    ids = torch.randint(0, 60, (2, 6), generator=torch.Generator().manual_seed(0))
    expected = reference(input_ids=ids).logits
    target = find_target(Holder(model), "model.backbone.layers")
    runtime = RoundPipeRuntime.attach(target.module, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        assert torch.equal(model(input_ids=ids).logits, expected)
    finally:
        runtime.detach()


def test_t5_stacks_are_refused_when_named_as_the_message_says():
    model = tiny("t5")
    runtime = RoundPipeRuntime.attach(find_target(Holder(model), "model.encoder.block").module, "cpu", 2,
                                      RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        with pytest.raises(Exception, match="hand values other than item 0 from block to block"):
            ids = torch.randint(0, 60, (2, 6))
            model(input_ids=ids, decoder_input_ids=ids)
    finally:
        runtime.detach()


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = tiny_model("llama")


def test_a_causal_lm_nested_one_level_down_gets_the_module_that_works():
    holder = Holder(Nested())
    with pytest.raises(PipelineTargetError, match=r"holds a Hugging Face model below it: model\.lm \(LlamaForCausalLM\)\. "
                                                  r"Name it: RoundPipeStrategy\(module='model\.lm'\)"):
        find_target(holder)
    target = find_target(holder, "model.lm")
    assert target.kind == "causal_lm" and target.module is holder.model.lm


class CallsTheDecoder(L.LightningModule):
    """A training_step that calls the decoder inside the causal LM, then the LM's own head."""

    def __init__(self, direct: bool):
        super().__init__()
        self.model, self.direct = tiny_model("llama"), direct

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        if self.direct:
            hidden = self.model.model(input_ids=ids).last_hidden_state
            logits = self.model.lm_head(hidden)
            return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module):
    data = DataLoader(TensorDataset(torch.randint(1, 60, (8, 12), generator=torch.Generator().manual_seed(0))),
                      batch_size=4)
    L.Trainer(strategy=RoundPipeStrategy(microbatches=2), accelerator="cpu", devices=2, max_steps=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, data)


@pytest.mark.timeout(90)
def test_calling_the_inner_decoder_directly_warns_once():
    module = CallsTheDecoder(direct=True)
    with pytest.warns(UnpipelinedCallWarning) as seen:
        _fit(module)
    texts = [str(w.message) for w in seen if issubclass(w.category, UnpipelinedCallWarning)]
    assert len(texts) == 1
    assert texts[0].startswith("RoundPipe: the LlamaModel inside the pipelined LlamaForCausalLM was called directly")
    assert not module.model.model._forward_pre_hooks and not module.model._forward_hooks  # hooks gone after fit


@pytest.mark.timeout(90)
def test_the_pipelined_call_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnpipelinedCallWarning)
        _fit(CallsTheDecoder(direct=False))


@pytest.mark.timeout(60)
def test_input_refusals_raise_the_projects_error_class():
    model = tiny_model("llama")
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        ids = torch.randint(1, 60, (2, 6))
        cases = [
            (dict(inputs_embeds=torch.randn(2, 6, 16)), r"takes input_ids \(inputs_embeds is not supported\)"),
            (dict(input_ids=ids, labels=ids[:, :5]), r"labels must have the shape of input_ids \(2, 6\), got \(2, 5\)"),
            (dict(input_ids=ids, frobnicate=1), r"does not take \['frobnicate'\]"),
            (dict(input_ids=ids, logits_to_keep="all"), "logits_to_keep must be an int or a tensor"),
        ]
        for kwargs, message in cases:
            with pytest.raises(UnsupportedInputError, match=message) as err:
                model(**kwargs)
            assert isinstance(err.value, ValueError) and type(err.value) is not ValueError
    finally:
        runtime.detach()
