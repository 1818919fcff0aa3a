"""Several pipelined calls and several backwards per optimizer step: exact with the overlapped optimizer."""

import contextlib

import pytest
import torch
from torch import nn

from _exact_models import GRAD_TOL, WEIGHT_TOL, SeqModule, parity
from lightning_roundpipe import PipelineError, RoundPipeRuntime, RuntimeOptions


class TwoCalls(SeqModule):
    """``mode`` says how ``training_step`` uses the pipelined ``net``."""

    def __init__(self, mode, **kwargs):
        super().__init__(**kwargs)
        self.mode = mode

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.mode == "siamese":  # two calls, one loss
            return ((self.net(x) - y) ** 2).mean() + ((self.net(0.5 * x) - y) ** 2).mean()
        if self.mode == "input_grad":  # autograd.grad for the input, then backward of the same loss
            x = x.clone().requires_grad_(True)
            loss = ((self.net(x) - y) ** 2).mean()
            (gx,) = torch.autograd.grad(loss, x, retain_graph=True)
            self.log("input_grad_norm", gx.norm())
            return loss
        if self.mode == "adversarial":  # the input gradient feeds a second call
            x = x.clone().requires_grad_(True)
            loss = ((self.net(x) - y) ** 2).mean()
            (gx,) = torch.autograd.grad(loss, x, retain_graph=True)
            return loss + ((self.net(x.detach() + 0.1 * gx.sign()) - y) ** 2).mean()
        if self.mode == "regulariser":  # a pipelined weight also used outside the pipeline, after it
            return ((self.net(x) - y) ** 2).mean() + 0.3 * self.net[0][0].weight.pow(2).sum()
        if self.mode == "outside":  # ... and before it: its gradient arrives after the pipeline's backward
            return ((self.net(x @ self.net[0][0].weight.t()) - y) ** 2).mean()
        if self.mode == "unused_call":  # a call whose output never reaches the loss
            self.net(2 * x)
            return ((self.net(x) - y) ** 2).mean()
        raise ValueError(self.mode)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["siamese", "input_grad", "adversarial", "regulariser", "outside", "unused_call"])
def test_several_calls_and_backwards_match_default_strategy(mode, opt):
    g_err, w_err = parity(lambda: TwoCalls(mode, opt=opt), max_steps=5)
    assert g_err <= GRAD_TOL, g_err
    assert w_err <= WEIGHT_TOL, w_err


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        attn_implementation="sdpa"))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_two_hugging_face_losses_in_one_step(opt):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from _models import fit, grad_error, weight_error, weights

    class TwoLosses(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _tiny_llama()

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            first = self.model(input_ids=ids, labels=ids).loss
            second = self.model(input_ids=ids.flip(1), labels=ids.flip(1)).loss
            return first + 0.5 * second

        def configure_optimizers(self):
            if opt == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.1)
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    ids = torch.randint(0, 64, (16, 10), generator=torch.Generator().manual_seed(3))
    data = TensorDataset(ids)
    from lightning_roundpipe import RoundPipeStrategy

    _, g_ref = fit(TwoLosses(), "auto", max_steps=1, batch_size=4, data=data)
    _, g = fit(TwoLosses(), RoundPipeStrategy(microbatches=2, overlap_optimizer=True), devices=2, max_steps=1, batch_size=4, data=data)
    assert grad_error(g, g_ref) <= GRAD_TOL
    # no callback in these runs: layers may step during backward
    ref = TwoLosses()
    w0 = weights(ref)
    fit(ref, "auto", max_steps=3, batch_size=4, data=data, record_grads=False)
    m = TwoLosses()
    fit(m, RoundPipeStrategy(microbatches=2, overlap_optimizer=True), devices=2, max_steps=3, batch_size=4, data=data, record_grads=False)
    assert weight_error(weights(m), weights(ref), w0) <= WEIGHT_TOL


# ------------------------------------------------------------------ plain PyTorch
def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)], nn.Linear(8, 2))


def _closure_training(pipelined: bool, declare_last: bool, steps=4):
    """A closure with two forward+backward rounds (the second call comes after the first backward)."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    runtime = ov = None
    if pipelined:
        runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
        ov = runtime.overlap_optimizer(opt, delay_per_layer_s=0.001)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(steps):
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 2, generator=g)

            def closure():
                opt.zero_grad()
                ((net(x) - y) ** 2).mean().backward()
                loss = ((net(x.flip(0)) - y) ** 2).mean()
                with ov.last_backward() if (ov is not None and declare_last) else contextlib.nullcontext():
                    loss.backward()
                return loss

            opt.step(closure)
        if runtime is not None:
            runtime.join()
        return {k: v.detach().clone() for k, v in net.state_dict().items()}
    finally:
        if runtime is not None:
            runtime.detach()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("declare_last", [False, True])
def test_closure_with_two_backwards_is_exact(declare_last):
    ref = _closure_training(False, False)
    got = _closure_training(True, declare_last)
    for k in ref:
        assert torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-6), k


@pytest.mark.timeout(60)
def test_input_gradient_leaves_weight_grads_alone():
    net = _net()
    x = torch.randn(6, 8, requires_grad=True)
    ref_gx, = torch.autograd.grad(net(x).pow(2).sum(), x)
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=3, step_metrics=False))
    try:
        loss = net(x).pow(2).sum()
        gx, = torch.autograd.grad(loss, x, retain_graph=True)
        assert torch.allclose(gx, ref_gx, rtol=1e-5, atol=1e-7)
        assert all(p.grad is None for p in net.parameters())
        loss.backward(inputs=[x], retain_graph=True)
        assert all(p.grad is None for p in net.parameters())
        assert torch.allclose(x.grad, ref_gx, rtol=1e-5, atol=1e-7)
        loss.backward()
        assert all(p.grad is not None for p in net.parameters())
    finally:
        runtime.detach()


@pytest.mark.timeout(60)
def test_double_backward_is_refused_before_weights_change():
    net = _net()
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        x = torch.randn(4, 8, requires_grad=True)
        with pytest.raises(PipelineError, match="create_graph=True"):
            torch.autograd.grad(net(x).sum(), x, create_graph=True)
        assert all(p.grad is None for p in net.parameters())
    finally:
        runtime.detach()


@pytest.mark.timeout(60)
def test_second_backward_without_recompute_recomputes_exactly():
    """recompute="never": the first backward frees the kept graphs; a second one recomputes from the stage inputs."""
    net = _net()
    x = torch.randn(4, 8, requires_grad=True)
    ref_gx, = torch.autograd.grad(net(x).pow(2).sum(), x)
    net(x).pow(2).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, recompute="never",
                                                                    step_metrics=False))
    try:
        loss = net(x).pow(2).sum()
        gx, = torch.autograd.grad(loss, x, retain_graph=True)
        assert torch.allclose(gx, ref_gx, rtol=1e-5, atol=1e-7)
        assert all(p.grad is None for p in net.parameters())
        loss.backward()
        for p, r in zip(net.parameters(), ref):
            assert torch.allclose(p.grad, r, rtol=1e-5, atol=1e-7)
    finally:
        runtime.detach()


@pytest.mark.timeout(60)
def test_last_call_of_a_step_still_steps_layers_during_backward():
    """Two calls in one loss: the second backward to run steps layers as they complete (overlap kept)."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    # several backward stages, so that layers complete one stage at a time
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, trace_steps=4, partition="params",
                                                                    recompute="always", testing={"compute_delay_s": 0.003}))
    ov = runtime.overlap_optimizer(opt, delay_per_layer_s=0.002)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    try:
        def closure():
            opt.zero_grad()
            loss = ((net(x) - y) ** 2).mean() + ((net(0.5 * x) - y) ** 2).mean()
            with ov.last_backward():
                loss.backward()
            return loss

        opt.step(closure)
        runtime.join()
        records = runtime.trace.records()
    finally:
        runtime.detach()
    last_step = max(r.step for r in records)  # the second call's forward and both backwards
    optim = [r for r in records if r.kind == "optim"]
    backward = [r for r in records if r.kind == "backward" and r.step == last_step]
    assert len(optim) == 5 and backward
    assert min(r.start for r in optim) < max(r.end for r in backward)
