"""The first batch's memory check prices sdpa attention as torch's CPU kernels run it (issue 43, item 12).

A tiny llama at 4 x 4096 tokens with ``attn_implementation="sdpa"`` used to pass the check and fail on a worker
(``WorkerOutOfMemoryError`` after its forward stages ran): the estimate priced a decoder layer's graph as its
output (64 B/token where it keeps 1,104), and ``recompute="auto"``, chosen for the assumed 512-token
microbatches, kept every microbatch's forward graph until backward (4 x 8.5 MiB on worker 0). Measurements:
``python -m benchmarks.figures.sdpa_cpu_memory``; the cap sweep is the slow test at the end.
"""

from __future__ import annotations

import copy
import re

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.cost.activations import (carry_bytes, decoder_backward_transient_bytes,
                                                  decoder_graph_bytes, sdpa_kept_mask_bytes_per_token)
from lightning_roundpipe.cost.hf_shape import shape_from_config
from lightning_roundpipe.schedule.plan import PlanError
from lightning_roundpipe.workers.device_memory import WorkerOutOfMemoryError

LONG = (4, 4096)  # 4 microbatches of one 4096-token sequence


def _llama(attn="sdpa"):
    from _family_configs import tiny_model

    model = tiny_model("llama", attn=attn)
    calls = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a: calls.append("decoder"))
    return model, calls


def _batch(shape, padded):
    ids = torch.randint(1, 64, shape, generator=torch.Generator().manual_seed(0))
    kwargs = dict(input_ids=ids, labels=ids)
    if padded:
        mask = torch.ones_like(ids)
        mask[0, :7] = 0
        kwargs["attention_mask"] = mask
    return kwargs


def _step(cap, shape=LONG, padded=False, attn="sdpa", recompute="auto"):
    """One pipelined step under ``cap``: ('trained', loss, grads, peak, recompute) or ('refused', error, calls)."""
    model, calls = _llama(attn)
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=shape[0], cpu_memory_cap_bytes=cap,
                                                               step_metrics=False, recompute=recompute))
    try:
        out = model(**_batch(shape, padded))
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return "trained", out.loss.detach(), grads, max(rt.pool.peak_device_bytes()), rt.planner.recompute
    except PlanError as err:
        assert all(p.grad is None for p in model.parameters())
        return "refused", str(err), len(calls)
    finally:
        rt.detach()


def _reference(shape=LONG, padded=False, attn="sdpa"):
    model, _ = _llama(attn)
    out = model(**_batch(shape, padded))
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _needed_bytes(message: str) -> int:
    return int(re.search(r"needs [\d.]+ \w+ \((\d+) bytes", message).group(1))


def _assert_exact(loss, grads, ref_loss, ref_grads):
    # the pipeline sums 4 microbatches where the reference runs one batch: fp32 summation order only
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(60)
def test_sdpa_long_sequences_under_a_small_cap_are_refused_before_any_layer_runs():
    # before: WorkerOutOfMemoryError in stage F0 after 14 decoder-layer calls (10 MB) and 18 (30 MB is now enough)
    kind, message, calls = _step(10_000_000)
    assert kind == "refused" and calls == 0
    shape, _ = shape_from_config(_llama()[0].config)
    # layer 1 (a decoder layer) alone: its input carry, its graph and its MLP's backward gradients, per token
    per_token = carry_bytes(shape, 4) + decoder_graph_bytes(shape, 4, None) + decoder_backward_transient_bytes(shape, 4)
    assert per_token == 144 + 1104 + 256
    assert message.startswith("layer 1 needs ") and f"one microbatch's activations {4096 * per_token / 2**20:.2f} MiB" in message
    assert "Raise cpu_memory_cap_bytes" in message


@pytest.mark.timeout(120)
def test_sdpa_cap_boundary_a_cap_at_the_estimate_trains_exactly_one_byte_less_is_refused():
    kind, message, calls = _step(10_000_000)
    need = _needed_bytes(message)  # a stage may use half the cap
    below = _step(2 * need - 2)
    assert below[0] == "refused" and below[2] == 0
    kind, loss, grads, peak, recompute = _step(2 * need)
    assert kind == "trained" and recompute is True  # the kept graphs of 4 microbatches do not fit: recomputed
    assert peak <= 2 * need
    _assert_exact(loss, grads, *_reference())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sdpa_kept_graphs_only_where_they_fit_the_first_batch():
    # 40 MB: keeping 4 microbatches' graphs (measured 40.0 MB on worker 0) is not priced to fit: recompute
    kind, loss, grads, peak, recompute = _step(40_000_000)
    assert kind == "trained" and recompute is True and peak <= 40_000_000
    # 100 MB: kept graphs fit the bound (every layer's graph for the whole batch) and train
    kind, loss, grads, peak, recompute = _step(100_000_000)
    assert kind == "trained" and recompute is False and 40_000_000 <= peak <= 100_000_000
    _assert_exact(loss, grads, *_reference())


@pytest.mark.timeout(60)
def test_recompute_never_is_refused_when_kept_graphs_exceed_the_cap():
    kind, message, calls = _step(40_000_000, recompute="never")
    assert kind == "refused" and calls == 0
    assert message.startswith("recompute='never' keeps the forward graphs of all 4 microbatches until their backward")
    assert "Use recompute='auto' or 'always'" in message and "cpu_memory_cap_bytes" in message


def _largest_need(shape, padded):
    """The check names the first layer over the cap: raise the cap to twice each need until the step trains.
    Returns the largest layer's need and the step trained under twice it."""
    cap = 1_000_000
    while True:
        result = _step(cap, shape, padded=padded)
        if result[0] == "trained":
            return cap // 2, result
        assert result[2] == 0
        cap = 2 * _needed_bytes(result[1])


@pytest.mark.timeout(120)
def test_sdpa_padded_rows_price_the_boolean_mask_and_its_kept_additive_copy():
    # A padded row makes Hugging Face's sdpa mask a dense boolean [b, 1, s, s] tensor in the carry, which every
    # sdpa call turns into an fp32 additive copy it keeps (cost/activations.py): at 1024 tokens 1 MiB carried
    # and 4 MiB per decoder layer, where the unpadded batch has none.
    shape = (4, 1024)
    unpadded, _ = _largest_need(shape, padded=False)
    padded, (kind, loss, grads, peak, _) = _largest_need(shape, padded=True)
    kept = sdpa_kept_mask_bytes_per_token(1024, 4)
    assert kept == 4096
    # a decoder layer's backward stage: per token the kept copy, and the boolean mask in the stage's input
    assert padded - unpadded == 1024 * (kept + 1024)
    assert kind == "trained" and peak <= 2 * padded
    _assert_exact(loss, grads, *_reference(shape, padded=True))
    # a cap enough for the unpadded batch refuses the padded one before it runs (it used to fail on the worker)
    refused = _step(2 * unpadded, shape, padded=True)
    assert refused[0] == "refused" and refused[2] == 0


# --------------------------------------------------------------------- under the Lightning Trainer
class LlamaModule(L.LightningModule):
    def __init__(self, model, opt):
        super().__init__()
        self.model, self.opt = model, opt

    def training_step(self, batch, batch_idx):
        ids, mask = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=ids).loss

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _fit(model, opt, strategy, devices):
    ids, mask = _fit_batches()
    module = LlamaModule(model, opt)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(ids, mask), batch_size=4))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fit_batches():
    ids = torch.randint(1, 64, (8, 1024), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # a padded row: dense sdpa masks
    return ids, mask


def _check_only(model, cap):
    """The first batch's memory check (PlanError when over ``cap``), then a forward without autograd."""
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=4, cpu_memory_cap_bytes=cap,
                                                               step_metrics=False))
    try:
        ids, mask = _fit_batches()
        with torch.no_grad():
            model(input_ids=ids[:4], attention_mask=mask[:4], labels=ids[:4])
    finally:
        rt.detach()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_fit_at_the_estimate_trains_like_the_default_strategy_and_below_it_is_refused(opt):
    model, calls = _llama()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cap, needs = 1_000_000, []
    while True:  # the check names the first layer over the cap: raise the cap to each need until none is over
        try:
            _check_only(model, cap)
            break
        except PlanError as err:
            needs.append(_needed_bytes(str(err)))
            cap = 2 * needs[-1]
    assert needs and all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    reference = _fit(copy.deepcopy(model), opt, "auto", 1)
    calls.clear()  # the copy's layers count on the same list
    with pytest.raises(PlanError):
        _fit(model, opt, RoundPipeStrategy(microbatches=4, cpu_memory_cap_bytes=cap - 2, overlap_optimizer=True), 2)
    assert calls == []
    pipelined = _fit(model, opt, RoundPipeStrategy(microbatches=4, cpu_memory_cap_bytes=cap, overlap_optimizer=True), 2)
    assert calls
    for name, ref in reference.items():
        update = (ref - start[name]).norm()
        assert update > 0, name
        assert (pipelined[name] - ref).norm() / update <= 1e-4, name  # DESIGN.md's bound after several steps


# --------------------------------------------------------------------- the sweep: no cap passes and then fails
def _outcome(cap, attn, padded=False, shape=LONG):
    try:
        result = _step(cap, shape, padded, attn)
    except WorkerOutOfMemoryError as err:  # what the check must never let through
        return "failed on the worker", str(err)
    return result[0], result


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("attn, padded, caps", [
    ("sdpa", False, [5e6, 10e6, 12e6, 13e6, 20e6, 30e6, 40e6, 50e6, 60e6, 70e6, 100e6]),
    ("sdpa", True, [50e6, 100e6, 200e6, 300e6, 400e6, 600e6, 1e9]),
    ("eager", False, [10e6, 100e6, 1.0e9, 1.1e9, 1.3e9, 1.5e9, 1.65e9, 1.8e9, 2.5e9, 4e9]),
])
def test_no_cap_passes_the_check_and_then_fails(attn, padded, caps):
    outcomes = {cap: _outcome(int(cap), attn, padded) for cap in caps}
    failed = {cap: o[1] for cap, o in outcomes.items() if o[0] == "failed on the worker"}
    assert not failed
    refused = [cap for cap, o in outcomes.items() if o[0] == "refused"]
    trained = [cap for cap, o in outcomes.items() if o[0] == "trained"]
    assert refused and trained and max(refused) < min(trained)  # one threshold, below which every cap is refused
