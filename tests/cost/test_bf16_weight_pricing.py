"""bf16-mixed weight pricing: the cost model's per-layer weight and gradient bytes are what a worker
really holds (cost/autocast_cast.py): Linear weights uploaded in bf16, embedding and norms in
fp32, trainable bf16 uploads held as fp32 leaves with fp32 gradients, plus autocast's bf16 copy;
the gradients of bf16 uploads downloaded in bf16 (``autocast_cast.download_dtype``)."""

import gc

import pytest
import torch
from torch import nn

from _family_configs import family_batch, tiny_model
from lightning_roundpipe.cost.estimate import estimate_costs
from lightning_roundpipe.options import PartitionConfig, RuntimeOptions
from lightning_roundpipe.cost.autocast_cast import autocast_cast_parameters
from lightning_roundpipe.params.weights import StageWeights
from lightning_roundpipe.runtime import RoundPipeRuntime
from lightning_roundpipe.workers.device_memory import AllocationTally
from lightning_roundpipe.workers.pool import DeviceMemory


LAYER_STAGES = [[i, i + 1] for i in range(5)]  # one pipelined layer per stage: embedding, 3 decoder layers, head


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (a tied weight counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def _measured_per_layer(model, monkeypatch):
    """Train one bf16-mixed step of ``model``, one layer per stage, and return per pipelined layer
    (bytes of the device weights, of their device gradients, of those gradients as downloaded), read
    as each stage is released."""
    seen: dict[int, tuple[int, int, int]] = {}
    release = StageWeights.release

    def measuring_release(self):
        layer = self.layer_ids[0]
        held = _storage_bytes(self.device)
        grads = _storage_bytes(self.device[i].grad for i in self.trainable_indices())
        downloads = _storage_bytes(self.device_grads())
        old = seen.get(layer, (0, 0, 0))
        seen[layer] = (max(old[0], held), max(old[1], grads), max(old[2], downloads))
        release(self)

    monkeypatch.setattr(StageWeights, "release", measuring_release)
    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2, compute_dtype=torch.bfloat16,
                                                                overlap_optimizer=False, step_metrics=False,
                                                                partition=PartitionConfig(policy="manual", manual_forward=LAYER_STAGES)))
    try:
        ids, mask, labels = family_batch(batch=4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        rt.pool.drain()
        layers = rt.layers
        return layers, [seen[i] for i in range(len(layers))], rt.pool.peak_weight_bytes()
    finally:
        rt.detach()


def _autocast_copy_bytes(layer: nn.Module) -> int:
    """Bytes autocast keeps while a task runs: measured by calling every Linear of ``layer`` on one row
    under bf16 autocast in a tally, outputs dropped (the cast copies stay cached until autocast exits)."""
    memory = DeviceMemory(0)
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    inputs = [torch.ones(1, m.in_features) for m in linears]
    with torch.autocast("cpu", dtype=torch.bfloat16), AllocationTally(memory):
        for m, x in zip(linears, inputs):
            m(x)  # the output and the input's cast die here; the weight's cast stays in autocast's cache
        gc.collect()
        return memory.tensor_bytes


@pytest.mark.timeout(120)
def test_llama_bf16_weight_and_gradient_bytes_are_what_the_worker_holds(monkeypatch):
    model = tiny_model("llama")
    layers, measured, ledger = _measured_per_layer(model, monkeypatch)
    costs = estimate_costs(layers, 16, None, torch.bfloat16)
    cast = autocast_cast_parameters(layers)
    for i, (layer, cost, (held, grads, downloads)) in enumerate(zip(layers, costs.layers, measured)):
        copies = _autocast_copy_bytes(layer)
        assert copies == sum(p.numel() * 2 for p in layer.parameters() if id(p) in cast)  # every Linear weight, once
        assert (cost.device_weight_bytes, cost.grad_bytes, cost.grad_download_bytes) == (
            held + copies, grads, downloads), f"layer {i}"
    # The embedding (layer 0) is uploaded and held in fp32; a decoder layer's Linear weights travel in bf16.
    embed = layers[0]
    rotary = sum(b.numel() * b.element_size() for b in embed.buffers())  # the prefix's inv_freq, as stored
    assert costs.layers[0].weight_bytes == costs.layers[0].device_weight_bytes == (
        4 * sum(p.numel() for p in embed.parameters()) + rotary)
    decoder = layers[1]
    linear = sum(p.numel() for p in decoder.parameters() if id(p) in cast)
    norms = sum(p.numel() for p in decoder.parameters() if id(p) not in cast)
    assert norms > 0 and linear > 0
    assert (costs.layers[1].weight_bytes, costs.layers[1].device_weight_bytes, costs.layers[1].grad_bytes,
            costs.layers[1].grad_download_bytes) == (
        2 * linear + 4 * norms, 6 * linear + 4 * norms, 4 * (linear + norms), 2 * linear + 4 * norms)
    # The workers' ledger counts the fp32 leaves too: its peak covers the largest stage's held leaves.
    assert max(ledger) >= max(h for h, _, _ in measured)


@pytest.mark.timeout(60)
def test_frozen_linear_weights_stay_bf16_on_the_worker():
    model = tiny_model("llama")
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)  # only the norms train
    layers = [model.model.layers[0]]
    cost = estimate_costs(layers, 16, None, torch.bfloat16).layers[0]
    cast = autocast_cast_parameters(layers)
    linear = sum(p.numel() for p in layers[0].parameters() if id(p) in cast)
    norms = sum(p.numel() for p in layers[0].parameters() if id(p) not in cast)
    assert (cost.weight_bytes, cost.device_weight_bytes, cost.grad_bytes, cost.grad_download_bytes) == (
        2 * linear + 4 * norms, 2 * linear + 4 * norms, 4 * norms, 4 * norms)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_the_simulators_shape_prices_a_decoder_layer_as_the_module_estimate(family):
    # The shape model (sim plan) and the module estimate (the strategy's planner) agree byte for byte on a
    # decoder layer under bf16, for dense Linear projections and for transformers 5's fused experts and
    # router (not Linear layers, so kept in fp32 as autocast_cast_parameters says).
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.transformer import ModelShape, shape_layer_costs

    model = tiny_model(family)
    c = model.config
    moe = dict(num_experts=c.num_experts, experts_per_token=c.num_experts_per_tok,
               expert_intermediate=c.moe_intermediate_size) if family == "qwen3_moe" else {}
    shape = ModelShape(family, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                       c.head_dim, c.vocab_size, c.num_hidden_layers, qk_norm=family == "qwen3_moe", **moe)
    real = estimate_costs([model.model.layers[0]], 16, None, torch.bfloat16).layers[0]
    sim = shape_layer_costs(shape, load_hardware("rtx4090"), 16, 1, 2).layers[1]
    assert (sim.weight_bytes, sim.device_weight_bytes, sim.grad_bytes, sim.grad_download_bytes) == (
        real.weight_bytes, real.device_weight_bytes, real.grad_bytes, real.grad_download_bytes)
