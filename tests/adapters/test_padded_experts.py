"""``moe_experts="padded_bmm"``: the sorted pairs padded to the busiest expert's count, one ``torch.bmm`` per projection.

Its parity against HF's loop for every MoE family of the matrix is in ``test_grouped_experts.py``
(``kernel="padded_bmm"``). Here: the capacity rule, experts that receive no token (forward and
backward, biases included), that the path really runs one batched GEMM per projection and reads
the host exactly once per call (so it cannot fall back to a loop unnoticed), that it takes fp16
rows, the runtime option, and (slow) Lightning parity with the default strategy.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from _family_configs import tiny_model
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.adapters.grouped_experts import (CAPACITY_MULTIPLE, GroupedExpertsForward, gate_of,
                                                          grouped_experts_forward, padded_capacity, sort_by_expert)
from test_grouped_experts import (Syncs, assert_loss_and_grads_match, fit, hf_loop_model, loss_logits_grads,
                                  mixtral_attached, relative)


def experts_of(model):
    return next(m for m in model.modules() if type(m).__name__.endswith("Experts"))


def routed_batch(experts_used, tokens=40, top_k=2, seed=0):
    """Hidden rows and a top-k routing that only ever picks ``experts_used`` (distinct per token)."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor(experts_used)
    index = torch.stack([used[torch.randperm(len(used), generator=g)[:top_k]] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return index, weights


def test_the_capacity_is_the_busiest_expert_rounded_up_to_a_tile():
    assert CAPACITY_MULTIPLE == 128
    assert padded_capacity(torch.tensor([3, 0, 130, 5])) == 256
    assert padded_capacity(torch.tensor([0, 0])) == 0 and padded_capacity(torch.tensor([128, 1])) == 128
    assert padded_capacity(torch.tensor([9, 2]), multiple=4) == 12
    index = torch.tensor([[0, 2], [2, 3], [2, 0]])
    route = sort_by_expert(index, 4, "padded_bmm")
    assert route["capacity"] == 128
    # pairs sorted by expert (stable): expert 0 gets tokens 0, 2; expert 2 tokens 0, 1, 2; expert 3 token 1
    assert route["token"].tolist() == [0, 2, 0, 1, 2, 1]
    assert route["slots"].tolist() == [0, 1, 256, 257, 258, 384]
    assert sort_by_expert(index, 4, "bmm")["capacity"] == 3  # the no-sync fallback: the tokens


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_that_receive_no_tokens(family):
    experts = experts_of(hf_loop_model(family))
    width = experts.gate_up_proj.shape[1 if experts.is_transposed else 2]
    index, weights = routed_batch([0, 2])  # experts 1 and 3 get nothing
    hidden = torch.randn(40, width, generator=torch.Generator().manual_seed(1))

    def run(forward):
        h = hidden.clone().requires_grad_(True)
        w = weights.clone().requires_grad_(True)
        experts.zero_grad(set_to_none=True)
        out = forward(h, w)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [out.detach(), h.grad, w.grad] + [p.grad.clone() for p in experts.parameters()]

    reference = run(lambda h, w: experts(h, index, w))  # HF's eager loop
    got = run(lambda h, w: grouped_experts_forward(experts, h, index, w, gate_of(experts), "padded_bmm"))
    assert len(got) == len(reference) >= 5
    for a, b in zip(got, reference):
        assert relative(a, b) <= 1e-6
    for grad in got[3:]:  # every expert parameter: the idle experts' slices get exactly zero
        assert torch.count_nonzero(grad[[1, 3]]) == 0 and torch.count_nonzero(grad[[0, 2]]) > 0


@pytest.mark.timeout(60)
def test_the_padded_path_runs_one_bmm_per_projection_and_reads_the_host_once(monkeypatch):
    model = hf_loop_model("gpt_oss")  # biased experts, the clamped gate
    experts = experts_of(model)
    index, weights = routed_batch([0, 1, 3])
    hidden = torch.randn(40, experts.hidden_size, requires_grad=True)
    operands = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: operands.append((a.shape, b.shape)) or bmm(a, b))
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: pytest.fail("the padded path called grouped_mm"))
    syncs = Syncs(monkeypatch)
    out = grouped_experts_forward(experts, hidden, index, weights, gate_of(experts), "padded_bmm")
    assert syncs.calls == ["item"]  # the capacity, once; no torch.where / nonzero of HF's loop
    e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_size
    assert operands == [((e, 128, h), (e, h, 2 * i)), ((e, 128, i), (e, i, h))]
    out.sum().backward()  # autograd's bmm backward runs in C++: no Python-level GEMM, no host read
    assert len(operands) == 2 and syncs.calls == ["item"]
    # a whole model: two bmm and one host read per MoE layer, none by HF's per-expert loop
    monkeypatch.undo()
    monkeypatch.setattr(torch, "bmm", lambda a, b: operands.append((a.shape, b.shape)) or bmm(a, b))
    for layer in model.model.layers:
        layer.mlp.experts.forward = GroupedExpertsForward(layer.mlp.experts, gate_of(layer.mlp.experts), "padded_bmm")
    operands.clear()
    syncs = Syncs(monkeypatch)
    model(input_ids=torch.randint(0, 64, (2, 12)))
    layers = len(model.model.layers)
    # (the masks' own torch.where calls are not HF's loop, whose torch.where(mask) also calls nonzero)
    assert len(operands) == 2 * layers and syncs.calls.count("item") == layers and "nonzero" not in syncs.calls


@pytest.mark.timeout(60)
def test_the_padded_path_takes_fp16_rows():
    experts = experts_of(hf_loop_model("qwen3_moe"))
    index, weights = routed_batch([0, 1, 2, 3])
    hidden = torch.randn(40, experts.gate_up_proj.shape[-1])
    exact = grouped_experts_forward(experts, hidden, index, weights, gate_of(experts), "padded_bmm")
    half = copy.deepcopy(experts).half()
    dtypes = []
    bmm = torch.bmm
    torch.bmm = lambda a, b: dtypes.append((a.dtype, b.dtype)) or bmm(a, b)
    try:
        out = grouped_experts_forward(half, hidden.half(), index, weights.half(), gate_of(half), "padded_bmm")
    finally:
        torch.bmm = bmm
    assert dtypes == [(torch.float16, torch.float16)] * 2 and out.dtype == torch.float16
    assert relative(out.float(), exact) <= 1e-2  # fp16 rounding of the same computation


@pytest.mark.timeout(60)
def test_the_runtime_option_installs_the_padded_path():
    with mixtral_attached("padded_bmm") as (model, ref, ref_grads):
        kernels = [vars(m)["forward"].kernel for m in model.modules()
                   if isinstance(vars(m).get("forward"), GroupedExpertsForward)]
        assert kernels == ["padded_bmm"] * 3
        got, grads = loss_logits_grads(model, "mixtral")  # pipelined, microbatched, layer-grain recompute
        assert_loss_and_grads_match(got, grads, ref, ref_grads)
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_padded_path_trains_like_the_default_strategy(optimizer):
    model = tiny_model("qwen3_moe")
    model.set_experts_implementation("eager")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference, _ = fit(copy.deepcopy(model), "auto", 1, optimizer)
    pipelined, grouped = fit(model, RoundPipeStrategy(microbatches=3, moe_experts="padded_bmm"), 2, optimizer)
    assert grouped
    for name, ref in reference.items():
        update = (ref - start[name]).norm()
        assert update > 0, name
        assert (pipelined[name] - ref).norm() / update <= 1e-4, name
