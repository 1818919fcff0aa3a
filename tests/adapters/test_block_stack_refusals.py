"""What is not a chain of blocks is refused with a message that says what to do, before any weight changes;
declared chains and compiled modules are pipelined exactly."""

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import DemoModel
from torch import nn
from torch.utils.data import TensorDataset

from _models import fit, grad_error, weight_error, weights
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.adapters.block_chain import BlockChainError
from lightning_roundpipe.adapters.stack_runtime import StackSetupError
from lightning_roundpipe.adapters.target import PipelineTargetError, find_target
from lightning_roundpipe.runtime import RoundPipeRuntime, RuntimeOptions
from test_block_stack_models import VOCAB, LMModule, NanoGPT, token_data

GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-4


class ArgBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale=None, table=None):
        y = torch.tanh(self.lin(x))
        if scale is not None:
            y = y * scale
        return y if table is None else y + table.mean()


class Stack(nn.Module):
    """Blocks in a ModuleList; ``mode`` says how forward uses them (only "chain" is a chain)."""

    def __init__(self, mode="chain", n=3):
        super().__init__()
        self.blocks = nn.ModuleList(ArgBlock() for _ in range(n))
        self.mode = mode
        self.gain = nn.Parameter(torch.full((8,), 2.0))

    def forward(self, x, table=None):
        if self.mode == "skip":  # code between two blocks
            for b in self.blocks:
                x = b(x) + 1.0
            return x
        if self.mode == "parallel":  # every block on the same input
            return torch.stack([b(x) for b in self.blocks]).sum(0)
        if self.mode == "collect":  # every block's output read afterwards
            outs = []
            for b in self.blocks:
                x = b(x)
                outs.append(x)
            return torch.stack(outs).sum(0)
        if self.mode == "per_block":  # another argument for each block
            for i, b in enumerate(self.blocks):
                x = b(x, scale=float(i + 1))
            return x
        if self.mode == "reversed":
            for b in reversed(self.blocks):
                x = b(x)
            return x
        if self.mode == "learned_scale":  # a tensor without batch dimension that needs a gradient
            for b in self.blocks:
                x = b(x, scale=self.gain)
            return x
        for b in self.blocks:
            x = b(x, table=table)
        return x


def attach(model):
    return RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))


@pytest.mark.parametrize("mode,message", [
    ("skip", r"the output of block 0 of the stack of 3 ArgBlock was used outside the chain of blocks \(add\)"),
    ("parallel", r"block 1 of the stack of 3 ArgBlock was not called with the output of block 0 as its first "
                 r"argument.*x = x \+ y, is not a chain.*roundpipe_layers\(\) method"),
    ("collect", r"the output of block 0 of the stack of 3 ArgBlock was used outside the chain of blocks \(stack\).*"
                r"Stop using intermediate outputs, or declare the chain"),
    ("per_block", r"block 1 of the stack of 3 ArgBlock was called with other arguments than block 0.*roundpipe_layers"),
    ("reversed", r"block 2 of the stack of 3 ArgBlock was called before block 0.*order 0\.\.2"),
    ("learned_scale", r"shape \(8,\) that requires grad but has no batch dimension.*Compute it inside the blocks"),
])
def test_a_forward_that_is_not_a_chain_is_refused_before_any_weight_changes(mode, message):
    torch.manual_seed(0)
    model = Stack(mode)
    before = weights(model)
    runtime = attach(model)
    try:
        with pytest.raises(BlockChainError, match=message):
            model(torch.randn(4, 8)).sum().backward()
        assert all(p.grad is None for p in model.parameters())
    finally:
        runtime.detach()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all("forward" not in vars(b) for b in model.blocks)


def test_batch_sized_argument_that_could_be_per_position_is_refused():
    model = Stack()
    runtime = attach(model)
    try:
        with pytest.raises(BlockChainError, match=r"shape \(8, 3\) whose dim 0 equals the batch size 8, which is also a "
                                                  r"dimension of the hidden state \(8, 8\).*batch size that differs"):
            model(torch.randn(8, 8), table=torch.randn(8, 3))
        out = model(torch.randn(4, 8), table=torch.randn(5, 3))  # no batch dimension: the same table for every sample
        assert out.shape == (4, 8)
    finally:
        runtime.detach()


def test_several_stacks_nothing_to_pipeline_and_attach_messages():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Stack(), Stack()

    with pytest.raises(PipelineTargetError, match=r"several block stacks in Two: a\.blocks \(3 x ArgBlock\), "
                                                  r"b\.blocks \(3 x ArgBlock\)\. Name the one .*module='b\.blocks'"):
        find_target(Two())
    with pytest.raises(PipelineTargetError, match=r"found no module to pipeline in DemoModel.*one stack of blocks.*"
                                                  r"give the module a roundpipe_layers\(\) method"):
        find_target(DemoModel())
    with pytest.raises(PipelineTargetError, match=r"RoundPipeRuntime.attach\(Linear\) names a Linear, which RoundPipe "
                                                  r"cannot split into layers.*roundpipe_layers") as err:
        RoundPipeRuntime.attach(nn.Linear(2, 2), "cpu", 2)
    assert "config" not in str(err.value)  # never an adapter the model was not meant for
    with pytest.raises(PipelineTargetError, match=r"RoundPipeRuntime.attach\(Two\) holds several block stacks"):
        RoundPipeRuntime.attach(Two(), "cpu", 2)
    shared = nn.ModuleList([ArgBlock()] * 2)
    with pytest.raises(StackSetupError, match="holds the same block object more than once"):
        RoundPipeRuntime.attach(shared, "cpu", 2)


class DeclaredGPT(nn.Module):
    """A forward that is no loop (blocks as separate attributes, the head tied), with its chain declared."""

    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.first, self.second = nn.Sequential(nn.Linear(dim, dim), nn.GELU()), nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        self.norm = nn.LayerNorm(dim)
        self.head = _TiedHead(self.embed, self.norm)

    def forward(self, idx):
        return self.head(self.second(self.first(self.embed(idx))))

    def roundpipe_layers(self):
        return [self.embed, self.first, self.second, self.head]


class _TiedHead(nn.Module):
    def __init__(self, embed, norm):
        super().__init__()
        self.embed, self.norm = embed, norm

    def forward(self, x):
        return self.norm(x) @ self.embed.weight.t()


class DeclaredModule(L.LightningModule):
    def __init__(self, opt):
        super().__init__()
        self.net, self.opt = DeclaredGPT(), opt

    def training_step(self, batch, i):
        idx, targets = batch
        return F.cross_entropy(self.net(idx).reshape(-1, VOCAB), targets.reshape(-1))

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_declared_chain_with_embedding_and_tied_head_on_the_workers_matches(opt):
    torch.manual_seed(0)
    m = DeclaredModule(opt)
    assert find_target(m).kind == "declared_chain"
    init, ref = weights(m), copy.deepcopy(m)
    _, g_ref = fit(ref, "auto", max_steps=3, data=token_data(), batch_size=6)
    _, g = fit(m, RoundPipeStrategy(microbatches=3), devices=2, max_steps=3, data=token_data(), batch_size=6)
    assert grad_error(g, g_ref) <= GRAD_TOL
    assert weight_error(weights(m), weights(ref), init) <= WEIGHT_TOL
    assert "forward" not in vars(m.net)


def test_declared_chain_must_list_modules():
    class Bad(nn.Module):
        def roundpipe_layers(self):
            return [nn.Linear(2, 2), torch.tanh]

    with pytest.raises(StackSetupError, match=r"Bad.roundpipe_layers\(\) must return a non-empty list of nn.Module "
                                              r"layers; items \[1\] are not modules"):
        RoundPipeRuntime.attach(Bad(), "cpu", 2)


class SeqModuleCompiled(L.LightningModule):
    """A compiled nn.Sequential attribute (torch.compile(nn.Sequential(...)))."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                               nn.Linear(16, 1)), backend="aot_eager")

    def training_step(self, batch, i):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_compiled_sequential_attribute_is_found_and_matches():
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 1, generator=g))
    m = SeqModuleCompiled()
    t = find_target(m)
    assert (t.path, t.kind) == ("net", "block_stack")
    init, ref = weights(m), copy.deepcopy(m)
    _, g_ref = fit(ref, "auto", max_steps=3, data=data, batch_size=6)
    _, gr = fit(m, RoundPipeStrategy(microbatches=2), devices=2, max_steps=3, data=data, batch_size=6)
    assert grad_error(gr, g_ref) <= GRAD_TOL
    assert weight_error(weights(m), weights(ref), init) <= WEIGHT_TOL
    assert "forward" in vars(m.net) and "forward" not in vars(m.net._orig_mod)  # dynamo's forward is left alone


@pytest.mark.parametrize("what", ["blocks", "whole model"])
def test_compiled_blocks_and_compiled_models_are_pipelined_exactly(what):
    torch.manual_seed(0)
    model = NanoGPT(layers=3)
    ref = copy.deepcopy(model)
    if what == "blocks":
        for i in range(3):
            model.transformer.h[i] = torch.compile(model.transformer.h[i], backend="aot_eager")
        call = model
    else:
        call = torch.compile(model, backend="aot_eager")
    idx, targets = token_data()[:6]
    ref(idx, targets)[1].backward()
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=3, step_metrics=False))
    try:
        assert runtime.module is model.transformer.h
        call(idx, targets)[1].backward()
    finally:
        runtime.detach()
    errs = [((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(model.parameters(), ref.parameters())]
    assert max(errs) <= GRAD_TOL
    blocks = [getattr(b, "_orig_mod", b) for b in model.transformer.h]
    assert all("forward" not in vars(b) for b in blocks)


def test_compiled_hugging_face_model_is_refused_with_what_to_do():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2)
    holder = nn.Module()
    holder.lm = torch.compile(LlamaForCausalLM(cfg), backend="eager")
    with pytest.raises(PipelineTargetError, match=r"lm is a torch.compile'd Hugging Face model.*Pass the model itself"):
        find_target(holder)


def test_declared_chain_that_differs_from_forward_is_refused_before_any_weight_changes():
    class Scaled(DeclaredGPT):
        def forward(self, idx):
            return self.head(2.0 * self.second(self.first(self.embed(idx))))  # code the declared chain leaves out

    torch.manual_seed(0)
    model = Scaled()
    before = weights(model)
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        with pytest.raises(StackSetupError, match=r"Scaled.roundpipe_layers\(\) does not compute what Scaled.forward "
                                                  r"computes: on the first sample of the first batch the outputs "
                                                  r"differ by [0-9.e+-]+ .*code between them belongs in a layer"):
            model(token_data()[:4][0]).sum().backward()
    finally:
        runtime.detach()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_block_search_leaves_hugging_face_models_to_their_adapter():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2)
    holder = nn.Module()
    holder.wrapper = nn.Module()
    holder.wrapper.lm = LlamaForCausalLM(cfg)
    with pytest.raises(PipelineTargetError, match="found no module to pipeline"):
        find_target(holder)  # not its decoder layers as a block stack
    assert find_target(holder, "wrapper.lm").kind == "causal_lm"
