"""Block-stack models train unchanged under strategy="roundpipe", exactly as under Lightning's default strategy.

Gradients within 1e-5 per tensor after one step; weights within 1e-4 of the update after 3 steps,
with SGD (no momentum, no clipping) and with AdamW.
"""

import copy

import pytest
import torch
from lightning.pytorch.demos import LightningTransformer
from torch import nn

from _models import fit, grad_error, weight_error, weights
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.adapters.target import find_target
from lightning_roundpipe.runtime import RoundPipeRuntime, RuntimeOptions
from test_block_stack_models import (VOCAB, EncoderLM, LitGPT, LMModule, NanoGPT, loader, no_dropout, token_data)

GRAD_TOL = 1e-5
WEIGHT_TOL = 1e-4
STEPS = 3


def parity(make_module, workers, microbatches=3, module=None, data=None):
    """(worst gradient error, worst weight error) of roundpipe against the default strategy, same init and data."""
    torch.manual_seed(0)
    m = make_module()
    init = weights(m)
    ref = copy.deepcopy(m)
    data = data or token_data()
    _, g_ref = fit(ref, "auto", max_steps=STEPS, data=data, batch_size=6)
    _, g = fit(m, RoundPipeStrategy(microbatches=microbatches, module=module), devices=workers, max_steps=STEPS,
               data=data, batch_size=6)
    return grad_error(g, g_ref), weight_error(weights(m), weights(ref), init), m


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("workers", [2, 3])
def test_nanogpt_with_tied_head_matches_default_strategy(opt, workers):
    g_err, w_err, m = parity(lambda: LMModule(NanoGPT(), opt), workers)
    assert g_err <= GRAD_TOL and w_err <= WEIGHT_TOL, (g_err, w_err)
    assert m.model.lm_head.weight is m.model.transformer.wte.weight
    assert all("forward" not in vars(b) for b in m.model.transformer.h)  # relays removed after fit


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_litgpt_style_blocks_with_rope_masks_and_padding_match(opt):
    # cos/sin/mask have no batch dimension (copied to each worker), the padding bias is split with the batch
    g_err, w_err, _ = parity(lambda: LMModule(LitGPT(), opt), 2, data=token_data(pad=True))
    assert g_err <= GRAD_TOL and w_err <= WEIGHT_TOL, (g_err, w_err)


def test_transformer_encoder_model_is_found_and_matches():
    g_err, w_err, _ = parity(lambda: LMModule(EncoderLM(), "adamw"), 3, microbatches=2)
    assert g_err <= GRAD_TOL and w_err <= WEIGHT_TOL, (g_err, w_err)


class OfflineTransformer(LightningTransformer):
    def prepare_data(self):
        pass  # the demo downloads WikiText-2 here; the tests feed their own tokens


class AdamWTransformer(OfflineTransformer):
    def configure_optimizers(self):
        # The key part of nn.MultiheadAttention's in_proj_bias has a zero gradient (softmax ignores a constant per
        # query), so its gradient is rounding noise, which Adam with eps=1e-8 turns into full-size steps: summing over
        # microbatches instead of the whole batch put that slice 0.58 of its update apart (the decoder's, which runs
        # unpipelined on the host, 0.13). eps=1e-4 keeps noise from moving weights; the tolerance is unchanged.
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3, eps=1e-4)


@pytest.mark.parametrize("cls,module", [
    (OfflineTransformer, "model.transformer.decoder"),  # the model holding the block list
    (AdamWTransformer, "model.transformer.encoder.layers"),  # the block list itself
])
def test_lightning_demo_transformer_matches(cls, module):
    # The demo's own training_step and optimizer (SGD lr=0.1); dropout off, since the pipeline's dropout masks are
    # reproducible but not the default strategy's.
    g_err, w_err, m = parity(lambda: no_dropout(cls(vocab_size=VOCAB)), 2, module=module)
    assert g_err <= GRAD_TOL and w_err <= WEIGHT_TOL, (g_err, w_err)


def test_demo_transformer_names_its_two_stacks():
    from lightning_roundpipe.adapters.target import PipelineTargetError

    with pytest.raises(PipelineTargetError, match=r"several block stacks in LightningTransformer: "
                       r"model\.transformer\.encoder\.layers \(2 x TransformerEncoderLayer\), "
                       r"model\.transformer\.decoder\.layers \(2 x TransformerDecoderLayer\)\. Name the one to "
                       r"pipeline with RoundPipeStrategy\(module='model\.transformer\.decoder\.layers'\)"):
        find_target(LightningTransformer(vocab_size=VOCAB))


def test_module_names_a_model_or_its_block_list():
    m = LMModule(NanoGPT())
    for path in (None, "model", "model.transformer.h"):
        t = find_target(m, path)
        assert (t.path, t.kind, t.module) == ("model.transformer.h", "block_stack", m.model.transformer.h)


def test_attach_from_plain_pytorch_matches_and_restores():
    torch.manual_seed(0)
    model = NanoGPT()
    ref = copy.deepcopy(model)
    idx, targets = token_data()[:6]
    ref(idx, targets)[1].backward()
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=3, step_metrics=False))
    try:
        assert runtime.module is model.transformer.h and len(runtime.layers) == 4
        loss = model(idx, targets)[1]
        loss.backward()
        assert loss.item() == pytest.approx(ref(idx, targets)[1].item(), rel=1e-6)
        errs = [((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(model.parameters(), ref.parameters())]
        assert max(errs) <= GRAD_TOL
        with torch.no_grad():  # evaluation: no autograd node, the same logits
            assert torch.allclose(model(idx)[0], ref(idx)[0], rtol=1e-5, atol=1e-6)
    finally:
        runtime.detach()
    assert all("forward" not in vars(b) for b in model.transformer.h)
    assert "forward" not in vars(model.transformer.h)


def test_two_forward_calls_per_step_and_a_stack_of_one_block():
    torch.manual_seed(0)
    model = NanoGPT(layers=1)
    ref = copy.deepcopy(model)
    a, b = token_data()[:4][0], token_data(seed=5)[:4][0]
    (ref(a)[0].square().mean() + ref(b)[0].mean()).backward()
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        (model(a)[0].square().mean() + model(b)[0].mean()).backward()
    finally:
        runtime.detach()
    errs = [((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(model.parameters(), ref.parameters())]
    assert max(errs) <= GRAD_TOL


class Seq2Seq(nn.Module):
    """Decoder blocks fed the encoder's output as a second argument: a per-sample input that needs a gradient."""

    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.memory = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(dim, 2, 32, dropout=0.0, batch_first=True) for _ in range(3))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, src, tgt):
        memory = torch.tanh(self.memory(self.embed(src)))
        x = self.embed(tgt)
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        for layer in self.layers:
            x = layer(x, memory, tgt_mask=mask, tgt_is_causal=True)
        return self.head(x)


def test_extra_argument_that_needs_a_gradient_gets_it():
    torch.manual_seed(0)
    model = Seq2Seq()
    ref = copy.deepcopy(model)
    src, tgt = token_data()[:6]
    ref(src, tgt).logsumexp(-1).mean().backward()
    runtime = RoundPipeRuntime.attach(model, "cpu", 3, RuntimeOptions(microbatches=3, step_metrics=False))
    try:
        model(src, tgt).logsumexp(-1).mean().backward()
    finally:
        runtime.detach()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert ((p.grad - q.grad).norm() / q.grad.norm()).item() <= GRAD_TOL, name
    assert model.memory.weight.grad.norm() > 0


def test_forward_stage_computes_bit_for_bit_what_the_model_computes():
    # nn.MultiheadAttention (batch_first) runs F.linear on a transposed input, whose kernel depends on whether the
    # weight requires grad: forward stages must upload weights with the host's flag (the output was 2.5e-5 off).
    torch.manual_seed(0)
    model = no_dropout(OfflineTransformer(vocab_size=VOCAB))
    ref = copy.deepcopy(model)
    idx, targets = token_data()[:6]
    expected = ref(idx, targets)
    runtime = RoundPipeRuntime.attach(model.model.transformer.encoder.layers, "cpu", 2,
                                      RuntimeOptions(microbatches=1, step_metrics=False))
    try:
        got = model(idx, targets)
    finally:
        runtime.detach()
    assert torch.equal(got, expected)
