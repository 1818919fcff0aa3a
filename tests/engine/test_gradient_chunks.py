"""A stage's weight gradients come home in byte-bounded downloads (``chunk_bytes``), exactly.

Before, a stage's gradients were one download task (up to ~2 GB for an 8B-width stage), while
the pool's in-flight bound counts tasks. Now each download is a run of trainable tensors of about
``chunk_bytes``; a tensor larger than that is a run of its own.
"""

import pytest
import torch
from torch import nn

from lightning_roundpipe import EngineOptions, PipelineEngine, Plan
from lightning_roundpipe.engine.step import TableSizes
from lightning_roundpipe.params.weights import LayerTable
from lightning_roundpipe.workers import make_pool
from lightning_roundpipe.workers.pool import Worker

from _models import mlp

WIDTH = 16  # a Linear's weight is 1024 bytes in fp32, its bias 64
CHUNK = 1500
PLAN = Plan(4, [(0, 2), (2, 4)], [(0, 2), (2, 4)])


def _train(backend, chunk_bytes, monkeypatch):
    """Two steps; returns the gradients and the bytes of every weight-gradient download submitted."""
    layers = mlp(depth=4, width=WIDTH, seed=3)
    downloads = []
    original = Worker.submit

    def submit(worker, queue, fn, deps, label, priority=0, nbytes=0, always=False):
        if label.kind == "wgrad":
            downloads.append((label.stage, nbytes))
        return original(worker, queue, fn, deps, label, priority, nbytes, always)

    monkeypatch.setattr(Worker, "submit", submit)
    eng = PipelineEngine(layers, make_pool(backend, 2), PLAN, EngineOptions(microbatches=3, chunk_bytes=chunk_bytes))
    g = torch.Generator().manual_seed(5)
    try:
        for _ in range(2):
            (eng(torch.randn(6, WIDTH, generator=g)) ** 2).mean().backward()
        grads = [p.grad.clone() if p.grad is not None else None for l in layers for p in l.parameters()]
    finally:
        eng.close()
        monkeypatch.undo()
    return grads, downloads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["cpu", "fake_cuda"])
def test_gradients_over_the_chunk_limit_come_home_in_bounded_downloads_bit_for_bit(backend, monkeypatch):
    whole, one_each = _train(backend, 32 << 20, monkeypatch)
    chunked, downloads = _train(backend, CHUNK, monkeypatch)
    stage_bytes = 2 * (WIDTH * WIDTH + WIDTH) * 4  # two Linear layers per stage
    assert sorted(set(one_each)) == [("B0", stage_bytes), ("B1", stage_bytes)]  # one task per stage at 32 MiB
    per_stage = {}
    for stage, nbytes in downloads[:len(downloads) // 2]:  # the first step's
        per_stage.setdefault(stage, []).append(nbytes)
    # [w0, b0, w1] reaches 1500 bytes, then [b1]: every download under chunk_bytes + the largest tensor
    assert per_stage == {"B1": [2112, 64], "B0": [2112, 64]}
    assert max(n for _, n in downloads) < CHUNK + WIDTH * WIDTH * 4
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_a_frozen_stage_still_has_one_empty_download_and_a_tensor_over_the_limit_is_its_own():
    layers = mlp(depth=4, width=WIDTH, seed=3)
    for layer in layers[:2]:
        for p in layer.parameters():
            p.requires_grad_(False)
    sizes = TableSizes([LayerTable(layer) for layer in layers], None, 100)
    assert sizes.grad_chunks(0, 2) == [(0, 2, 0)]  # nothing trainable: one empty download (it carries errors)
    # w2 alone (over the limit), then b2 + w3, then b3
    assert sizes.grad_chunks(2, 4) == [(2, 4, 1024), (2, 4, 1088), (2, 4, 64)]
