"""A stack's calling convention is detected before anything runs: chains are pipelined, the rest refused clearly.

Blocks that return ``(x, attn)`` with a loop that keeps item 0 (``x = block(x)[0]`` or
``x, _ = block(x)``) are a chain: exact against the default strategy. T5's blocks hand their
position bias from block to block: refused before any weight changes. Hugging Face models that
are not causal LMs (BERT) are refused with the ``module=`` that pipelines their stack of blocks.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.adapters.block_chain import BlockChainError
from lightning_roundpipe.adapters.hf_causal_lm import UnsupportedModelError
from lightning_roundpipe.runtime import RoundPipeRuntime, RuntimeOptions
from test_block_stack import GRAD_TOL, WEIGHT_TOL, parity
from test_block_stack_models import VOCAB, LMModule
from _models import weights


class AttentionBlock(nn.Module):
    """Returns (x, attention weights), as blocks that can report their attention do."""

    def __init__(self, dim=16):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(1, 2) / 4.0, dim=-1)
        x = x + attn @ v
        return x + self.mlp(x), attn


class TupleLM(nn.Module):
    """A block stack whose blocks return tuples; ``unpack`` says how the loop keeps item 0."""

    def __init__(self, unpack="index", layers=3, dim=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(AttentionBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)
        self.unpack = unpack

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            if self.unpack == "index":
                x = block(x)[0]
            elif self.unpack == "unpack":
                x, _ = block(x)
            else:  # "collect": the attention maps are used, so the blocks are no chain
                x, attn = block(x)
                x = x + 0.0 * attn.mean()
        return self.head(x)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("unpack", ["index", "unpack"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_blocks_returning_x_and_attention_are_a_chain_and_match(opt, unpack):
    g_err, w_err, m = parity(lambda: LMModule(TupleLM(unpack), opt), 2)
    assert g_err <= GRAD_TOL and w_err <= WEIGHT_TOL, (g_err, w_err)
    assert all("forward" not in vars(b) for b in m.model.blocks)


def attach(model, **options):
    return RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False, **options))


def refused_unchanged(model, call, match, monkeypatch):
    """(message, pipelined calls) of ``call()`` on the attached ``model``, which raises BlockChainError matching
    ``match`` and changes nothing."""
    before = weights(model)
    runs = []
    real_run = RoundPipeRuntime.run
    monkeypatch.setattr(RoundPipeRuntime, "run", lambda self, *a, **k: runs.append(1) or real_run(self, *a, **k))
    runtime = attach(model)
    try:
        with pytest.raises(BlockChainError, match=match) as err:
            call()
        calls = len(runs)
    finally:
        runtime.detach()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    return str(err.value), calls


def test_a_tuple_item_the_loop_uses_is_refused_before_the_pipeline_runs(monkeypatch):
    model = TupleLM("collect")
    idx = torch.randint(0, VOCAB, (4, 6))
    message, calls = refused_unchanged(model.blocks, lambda: model(idx).sum().backward(),
                                       r"item 1 of the output of block 0 of the stack of 3 AttentionBlock was used "
                                       r"outside the chain \(mean\)", monkeypatch)
    assert "x = block(x)[0]" in message and "roundpipe_layers" in message
    assert calls == 0  # refused before the pipeline ran


def tiny_t5():
    config = AutoConfig.for_model("t5", vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
                                  num_heads=2, dropout_rate=0.0, decoder_start_token_id=0)
    torch.manual_seed(0)
    return AutoModel.from_config(config)


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_t5_blocks_are_refused_before_any_weight_changes(stack, monkeypatch):
    model = tiny_t5()
    ids = torch.randint(1, 32, (4, 5))
    message, calls = refused_unchanged(
        getattr(model, stack).block,
        lambda: model(input_ids=ids, decoder_input_ids=ids, use_cache=False).last_hidden_state.sum().backward(),
        r"block 1 of the stack of 2 T5Block got item 1 of the output of block 0 of the stack of 2 T5Block as an "
        r"argument", monkeypatch)
    assert "not a chain" in message and "roundpipe_layers" in message
    assert calls == 0


def test_t5_decoder_with_its_cache_is_refused_for_the_cache_first(monkeypatch):
    model = tiny_t5()  # T5's decoder caches by default; its blocks then share an EncoderDecoderCache
    ids = torch.randint(1, 32, (4, 5))
    _, calls = refused_unchanged(
        model.decoder.block, lambda: model(input_ids=ids, decoder_input_ids=ids).last_hidden_state.sum().backward(),
        r"block 0 of the stack of 2 T5Block gets a key/value cache \(EncoderDecoderCache\).*use_cache=False",
        monkeypatch)
    assert calls == 0


def test_bert_refusal_names_the_module_that_pipelines_its_blocks():
    config = AutoConfig.for_model("bert", vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32)
    for model in (AutoModel.from_config(config), AutoModelForSequenceClassification.from_config(config)):
        with pytest.raises(UnsupportedModelError) as err:
            RoundPipeRuntime.attach(model, "cpu", 2)
        prefix = "bert." if hasattr(model, "bert") else ""
        assert (f"it is built from a stack of blocks, {prefix}encoder.layer (2 x BertLayer), which can be pipelined "
                f"by itself: RoundPipeStrategy(module='<path to the model>.{prefix}encoder.layer')") in str(err.value)
        assert "forward" not in vars(model)


def test_bert_blocks_named_with_module_match_the_unpipelined_model():
    config = AutoConfig.for_model("bert", vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = AutoModel.from_config(config)
    ids = torch.randint(1, 32, (4, 5))
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0
    ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    ref.pow(2).sum().backward()
    g_ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    runtime = attach(model.encoder.layer)
    try:
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out.pow(2).sum().backward()
    finally:
        runtime.detach()
    assert (out - ref).norm() / ref.norm() <= 1e-6
    for name, g in g_ref.items():
        if g.norm() < 1e-12:  # the key bias: zero by softmax's shift invariance, its "gradient" is rounding noise
            continue
        assert (model.get_parameter(name).grad - g).norm() / g.norm() <= 1e-5, name


class BertModule(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0]).last_hidden_state.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_strategy_names_the_full_module_path_of_a_refused_bert():
    config = AutoConfig.for_model("bert", vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32)
    module = BertModule(AutoModel.from_config(config))
    before = weights(module)
    trainer = L.Trainer(strategy=RoundPipeStrategy(), accelerator="cpu", devices=2, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.randint(1, 32, (8, 5))), batch_size=4)
    with pytest.raises(UnsupportedModelError, match=r"RoundPipeStrategy\(module='model\.encoder\.layer'\)"):
        trainer.fit(module, data)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())
