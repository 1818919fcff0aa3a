"""A first batch longer than the plan's estimate is checked against the memory cap before any layer
runs (issue 43, item 12): the plan is priced for 512 tokens per microbatch until a batch is seen,
and a cap that fits those but not the real microbatches used to be found out by a worker's
allocation, after the first stages had run."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _models import weights
from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.schedule.plan import PlanError


class CountedLinear(nn.Linear):
    """A Linear that counts its forward calls (on any worker) in ``calls``."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


def narrow_then_wide(seed=0):
    """Two narrow layers, then one whose output is 32 times wider: its activations break the cap."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Sequential(CountedLinear(8, 8), nn.Tanh()), nn.Sequential(CountedLinear(8, 8), nn.Tanh()),
                         nn.Sequential(CountedLinear(8, 256), nn.Tanh()), CountedLinear(256, 1))


# A stage may use half the cap (1.2 MB): 512-row microbatches (the estimate) fit every layer (the wide
# one: 0.5 MB of activations); 3,000-row ones fit the narrow layers (96 KB) but not the wide one (3 MB).
CAP = 2_400_000
ROWS = 6_000  # 2 microbatches of 3,000 rows


class Regression(L.LightningModule):
    def __init__(self, opt):
        super().__init__()
        self.net, self.opt = narrow_then_wide(), opt

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=0.01)


@pytest.mark.timeout(60)
def test_runtime_refuses_the_first_long_batch_before_any_layer_runs():
    net = narrow_then_wide()
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, cpu_memory_cap_bytes=CAP,
                                                               step_metrics=False))
    try:
        assert rt.planner.budget_checked_tokens == 512  # the estimate fitted the cap
        CountedLinear.calls = 0
        with pytest.raises(PlanError, match=r"^layer 2 needs .*Raise cpu_memory_cap_bytes, use fewer tokens per microbatch"):
            net(torch.randn(ROWS, 8)).square().mean().backward()
        assert CountedLinear.calls == 0
        assert all(p.grad is None for p in net.parameters())
        net(torch.randn(16, 8)).square().mean().backward()  # a batch that fits runs
        assert CountedLinear.calls >= 4 * 2  # every layer ran forward on both microbatches
    finally:
        rt.detach()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_fit_refuses_the_first_long_batch_before_any_layer_runs_and_weights_stay(opt):
    module = Regression(opt)
    before = weights(module)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 1, generator=g)),
                      batch_size=ROWS)
    trainer = L.Trainer(strategy=RoundPipeStrategy(microbatches=2, cpu_memory_cap_bytes=CAP, overlap_optimizer=True),
                        accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    CountedLinear.calls = 0
    with pytest.raises(PlanError, match=r"layer 2 needs .*one microbatch's activations"):
        trainer.fit(module, data)
    assert CountedLinear.calls == 0
    assert all(torch.equal(w, before[k]) for k, w in weights(module).items())


# --------------------------------------------------------------------- a Hugging Face model's long sequences
# A tiny llama with eager attention at 4 x 4096 tokens: one 4096-token sequence per microbatch holds a
# 64 MiB additive mask in its carry and 128 MiB score tensors in each decoder layer (2 heads x 4096^2 x
# fp32), where its hidden states are 256 KiB. The estimate used to count only the hidden states, so the
# caps below were found out by a worker's allocation in the embedding stage.
LONG = (4, 4096)


def _llama_with_layer_calls():
    from _family_configs import tiny_model

    model = tiny_model("llama", attn="eager")
    calls = []
    model.model.embed_tokens.register_forward_pre_hook(lambda m, a: calls.append("embed"))
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a: calls.append("decoder"))
    return model, calls


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cap", [10_000_000, 100_000_000])
def test_hf_long_sequences_over_the_cap_are_refused_before_the_embedding_runs(cap):
    model, calls = _llama_with_layer_calls()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, 64, LONG, generator=torch.Generator().manual_seed(0))
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=4, cpu_memory_cap_bytes=cap,
                                                               step_metrics=False))
    try:
        with pytest.raises(PlanError) as err:
            model(input_ids=ids, labels=ids).loss.backward()
        text = str(err.value)
        # layer 0 is the embedding prefix: its output carries the 64 MiB mask of one 4096-token sequence beside
        # the hidden state, cos, sin, position ids and labels (144 B/token, cost.activations.carry_bytes)
        assert text.startswith("layer 0 needs ") and f"({cap} bytes)" in text
        assert "one microbatch's activations 64.56 MiB" in text
        assert ("Raise cpu_memory_cap_bytes, use fewer tokens per microbatch (more microbatches, or shorter "
                "sequences: attention scores and masks grow with their square), or split the layer.") in text
        assert calls == []
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
        assert all(p.grad is None for p in model.parameters())
    finally:
        rt.detach()


@pytest.mark.timeout(60)
def test_hf_decoder_layer_scores_are_priced_and_named():
    # A cap whose half holds the mask carry but not a decoder layer's scores: the decoder layer is named,
    # with its activations per token: the carry in (144 B + the 16 KiB mask), its graph (1,104 B, counted in
    # cost.activations, the mask and one kept score tensor of 32 KiB) and in backward two transient score
    # tensors and its MLP's gradients (64 KiB + 256 B): 132,576 B, 517.88 MiB for 4096 tokens.
    model, calls = _llama_with_layer_calls()
    ids = torch.randint(1, 64, LONG, generator=torch.Generator().manual_seed(0))
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=4, cpu_memory_cap_bytes=10**9,
                                                               step_metrics=False))
    try:
        with pytest.raises(PlanError, match=r"^layer 1 needs 517\.89 MiB .*one microbatch's activations 517\.88 MiB"):
            model(input_ids=ids, labels=ids).loss.backward()
        assert calls == []
    finally:
        rt.detach()


@pytest.mark.timeout(120)
def test_hf_sequences_that_fit_the_cap_train():
    # 4 x 512 tokens, eager: the measured peak under this cap is 19.0 MB (worker 0; 8.9 MB under a 20 MB cap, where
    # the partitioner cuts smaller stages); a 100 MB cap is not refused and the
    # step equals the unpipelined model's loss and gradients.
    model, calls = _llama_with_layer_calls()
    ids = torch.randint(1, 64, (4, 512), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    calls.clear()
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=4, cpu_memory_cap_bytes=100_000_000,
                                                               step_metrics=False))
    try:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        peak = max(rt.pool.peak_device_bytes())
    finally:
        rt.detach()
    assert 0 < peak <= 100_000_000 and calls
    torch.testing.assert_close(out.loss.detach(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_long_sequences_under_a_cap_that_fits_train():
    # 4 x 4096 tokens, eager, 4 GB: the measured peak is 1.65 GB (worker 0, the backward stage of the
    # embedding and two decoder layers); the check must not refuse it.
    model, calls = _llama_with_layer_calls()
    ids = torch.randint(1, 64, LONG, generator=torch.Generator().manual_seed(0))
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=4, cpu_memory_cap_bytes=4 * 10**9,
                                                               step_metrics=False))
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        assert calls and 0 < max(rt.pool.peak_device_bytes()) <= 4 * 10**9
        assert all(p.grad is not None for p in model.parameters())
    finally:
        rt.detach()
