"""Chunked LM-head cross-entropy: parity with the plain reference and the O(chunk x vocab) bound."""


import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_roundpipe.adapters.chunked_loss import LogitTransform, chunked_lm_head_loss, plain_lm_head_loss


def make_inputs(rows=37, hidden=16, vocab=50, with_bias=False, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.1).to(dtype).requires_grad_() if with_bias else None
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[::5] = -100  # some ignored rows
    return h, w, b, labels


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_loss_and_grads_match_plain_reference(chunk_size, with_bias):
    h, w, b, labels = make_inputs(with_bias=with_bias)
    inputs = [h, w] + ([b] if with_bias else [])
    ref = plain_lm_head_loss(h, w, labels, bias=b)
    ref_grads = torch.autograd.grad(ref, inputs)
    got = chunked_lm_head_loss(h, w, labels, chunk_size=chunk_size, bias=b)
    got_grads = torch.autograd.grad(got, inputs)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for g, g_ref in zip(got_grads, ref_grads):
        assert rel_err(g, g_ref) < 1e-6


def test_backward_scales_by_incoming_gradient():
    h, w, _, labels = make_inputs()
    ref_grads = torch.autograd.grad(plain_lm_head_loss(h, w, labels) * -2.5, [h, w])
    got_grads = torch.autograd.grad(chunked_lm_head_loss(h, w, labels, chunk_size=6) * -2.5, [h, w])
    for g, g_ref in zip(got_grads, ref_grads):
        assert rel_err(g, g_ref) < 1e-6


def test_only_weight_requires_grad():
    h, w, _, labels = make_inputs()
    h = h.detach()
    (g_ref,) = torch.autograd.grad(plain_lm_head_loss(h, w, labels), [w])
    (g,) = torch.autograd.grad(chunked_lm_head_loss(h, w, labels, chunk_size=7), [w])
    assert rel_err(g, g_ref) < 1e-6


def test_no_grad_forward_returns_same_loss_without_graph():
    h, w, _, labels = make_inputs()
    with torch.no_grad():
        loss = chunked_lm_head_loss(h, w, labels, chunk_size=5)
    assert not loss.requires_grad
    assert abs(loss.item() - plain_lm_head_loss(h, w, labels).item()) <= 1e-6 * loss.item()


def test_all_ignored_gives_zero_loss_and_zero_grads():
    h, w, _, labels = make_inputs()
    labels = torch.full_like(labels, -100)
    loss = chunked_lm_head_loss(h, w, labels, chunk_size=4)
    gh, gw = torch.autograd.grad(loss, [h, w])
    assert loss.item() == 0.0
    assert gh.abs().max().item() == 0.0 and gw.abs().max().item() == 0.0


def test_bf16_matches_reference_within_bf16_precision():
    h, w, _, labels = make_inputs(rows=64, hidden=32, vocab=96, dtype=torch.bfloat16)
    ref = plain_lm_head_loss(h, w, labels)
    ref_grads = torch.autograd.grad(ref, [h, w])
    got = chunked_lm_head_loss(h, w, labels, chunk_size=16)
    got_grads = torch.autograd.grad(got, [h, w])
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert got_grads[0].dtype == torch.bfloat16 and got_grads[1].dtype == torch.bfloat16
    for g, g_ref in zip(got_grads, ref_grads):
        assert rel_err(g, g_ref) < 1e-2


def test_observer_sees_only_chunk_sized_logits():
    rows, vocab, chunk = 37, 50, 8
    h, w, _, labels = make_inputs(rows=rows, vocab=vocab)
    shapes = []
    loss = chunked_lm_head_loss(h, w, labels, chunk_size=chunk, on_logits_chunk=lambda t: shapes.append(tuple(t.shape)))
    loss.backward()
    assert shapes == [(8, vocab)] * 4 + [(5, vocab)]


class _LargestTensorRecorder(TorchDispatchMode):
    """Records the element count of every tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_allocates_more_than_a_chunk_of_logits():
    # Sizes chosen so that full logits (rows x vocab) dwarf everything else the function must
    # hold: the weight and its gradient (vocab x hidden) and one logits chunk (chunk x vocab).
    rows, hidden, vocab, chunk = 256, 4, 512, 4
    h, w, _, labels = make_inputs(rows=rows, hidden=hidden, vocab=vocab)
    recorder = _LargestTensorRecorder()
    with recorder:
        loss = chunked_lm_head_loss(h, w, labels, chunk_size=chunk)
        loss.backward()
    assert recorder.largest <= max(chunk * vocab, vocab * hidden, rows * hidden)
    assert recorder.largest < rows * vocab // 16

    reference_recorder = _LargestTensorRecorder()  # the recorder does see full logits when they exist
    with reference_recorder:
        plain_lm_head_loss(h.detach(), w.detach(), labels)
    assert reference_recorder.largest == rows * vocab


def test_shape_errors_are_clear():
    h, w, _, labels = make_inputs()
    with pytest.raises(ValueError, match="shape mismatch"):
        chunked_lm_head_loss(h, w[:, :3], labels)
    with pytest.raises(ValueError, match=r"hidden \[n, h\]"):
        chunked_lm_head_loss(h.unsqueeze(0), w, labels)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_lm_head_loss(h, w, labels, chunk_size=0)


@pytest.mark.parametrize("transform", [
    LogitTransform(softcap=2.0),
    LogitTransform(multiplier=0.3),
    LogitTransform(divisor=5.0, softcap=1.5),
])
def test_logit_transform_inside_the_chunks_matches_full_logits(transform):
    torch.manual_seed(0)
    hidden = torch.randn(13, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    labels = torch.randint(0, 20, (13,))
    labels[2] = -100
    ref = plain_lm_head_loss(hidden, weight, labels, transform=transform)
    g_ref = torch.autograd.grad(ref * 1.7, (hidden, weight))
    got = chunked_lm_head_loss(hidden, weight, labels, chunk_size=4, transform=transform)
    g = torch.autograd.grad(got * 1.7, (hidden, weight))
    assert abs(got.item() / ref.item() - 1) <= 1e-6
    for a, b in zip(g, g_ref):
        assert (a - b).norm() / b.norm() <= 1e-6
    identity = plain_lm_head_loss(hidden, weight, labels)
    assert abs(identity.item() - ref.item()) > 1e-3  # the transform really changes the loss
