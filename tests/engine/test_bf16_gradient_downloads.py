"""bf16-mixed gradient downloads (issue 44, item 4): a stage's gradient of a weight uploaded in bf16 is
its microbatches summed in fp32 on the worker, rounded to bf16 once and downloaded in bf16, as each
backward call under Lightning's bf16-mixed adds one bf16 gradient (that of autocast's cast) into the
fp32 ``.grad``. Weights uploaded in fp32 (embedding, norms) keep fp32 downloads; fp32 runs are unchanged.
Exactness against Lightning's bf16-mixed: tests/lightning/test_bf16_mixed_parity.py."""

import pytest
import torch

from _family_configs import family_batch, tiny_model
from lightning_roundpipe.cost.autocast_cast import autocast_cast_parameters
from lightning_roundpipe.options import RuntimeOptions
from lightning_roundpipe.params.weights import StageWeights
from lightning_roundpipe.runtime import RoundPipeRuntime


def _one_call(model, monkeypatch, compute_dtype):
    """One forward and backward of ``model`` on 2 CPU workers, 3 microbatches; returns the dtypes and
    bytes of every weight-gradient download, and the device gradients' own bytes (the old downloads)."""
    downloads, device = [], [0]
    device_grads = StageWeights.device_grads

    def counting(self, indices=None):
        out = device_grads(self, indices)
        downloads.extend((g.dtype, g.numel() * g.element_size()) for g in out if g is not None)
        device[0] += sum(self.device[i].grad.numel() * self.device[i].grad.element_size()
                         for i in (self.trainable_indices() if indices is None else indices))
        return out

    monkeypatch.setattr(StageWeights, "device_grads", counting)
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=3, compute_dtype=compute_dtype,
                                                                overlap_optimizer=False, step_metrics=False))
    try:
        ids, mask, labels = family_batch(batch=6)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype is not None):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        rt.pool.drain()
    finally:
        rt.detach()
    return downloads, device[0]


@pytest.mark.timeout(60)
def test_bf16_uploads_download_their_gradient_rounded_to_bf16_once(monkeypatch):
    model = tiny_model("llama")
    cast = autocast_cast_parameters([model])
    downloads, device_bytes = _one_call(model, monkeypatch, torch.bfloat16)
    linear = sum(p.numel() for p in model.parameters() if id(p) in cast)
    other = sum(p.numel() for p in model.parameters() if id(p) not in cast)
    assert sum(b for _, b in downloads) == 2 * linear + 4 * other
    assert device_bytes == 4 * (linear + other)  # the worker sums the microbatches in fp32
    assert {d for d, _ in downloads} == {torch.bfloat16, torch.float32}
    for name, p in model.named_parameters():
        rounded = p.grad.bfloat16().float()
        if id(p) in cast:  # one call: .grad is exactly one bf16 value per element
            assert torch.equal(p.grad, rounded), name
    # The embedding and the norms are uploaded in fp32: their gradient is not rounded.
    assert not torch.equal(model.model.embed_tokens.weight.grad, model.model.embed_tokens.weight.grad.bfloat16().float())


@pytest.mark.timeout(60)
def test_fp32_runs_download_fp32_gradients(monkeypatch):
    model = tiny_model("llama")
    downloads, device_bytes = _one_call(model, monkeypatch, None)
    assert {d for d, _ in downloads} == {torch.float32}
    assert sum(b for _, b in downloads) == device_bytes == 4 * sum(p.numel() for p in model.parameters())
