"""Issue 15 item 5: downloads land in right-sized host buffers that are reused from step to step."""

import gc

import pytest

import torch

from lightning_roundpipe import EngineOptions, PipelineEngine, Plan
from lightning_roundpipe.workers import make_pool
from lightning_roundpipe.workers.host_buffers import HostBufferPool

from _models import mlp

PLAN = Plan(5, [(0, 1), (1, 2), (2, 3), (3, 5)], [(0, 2), (2, 5)])


def test_host_buffer_pool_lends_exact_sizes_and_takes_back_only_its_own():
    made = []
    pool = HostBufferPool(lambda shape, dtype: made.append(shape) or torch.empty(shape, dtype=dtype))
    a = pool.take((3, 5), torch.bfloat16)
    assert a.shape == (3, 5) and a.dtype == torch.bfloat16 and pool.allocated_bytes == 30
    assert pool.give_back([a, torch.empty(3, 5, dtype=torch.bfloat16), None]) == 1  # a stranger is ignored
    b = pool.take((3, 5), torch.bfloat16)
    assert b is a and pool.reuses == 1 and pool.allocations == 1
    c = pool.take((3, 5), torch.float32)  # another dtype: another buffer
    assert c is not a and made == [(3, 5), (3, 5)] and pool.allocated_bytes == 30 + 60
    assert pool.lent_count == 2 and pool.free_bytes() == 0


def _steps(pool, steps, retain=False):
    layers = mlp(depth=PLAN.num_layers, width=16, dropout=0.25, seed=3)
    eng = PipelineEngine(layers, pool, PLAN, EngineOptions(microbatches=3))
    g = torch.Generator().manual_seed(5)
    seen = []
    try:
        torch.manual_seed(11)
        for _ in range(steps):
            x = torch.randn(6, 16, generator=g, requires_grad=True)
            gc.collect()  # calls that are gone hand their kept activations back (see StepRun.lent_buffers)
            loss = (eng(x) ** 2).mean()
            if retain:  # a second backward of one call recomputes from the kept activations
                gx, = torch.autograd.grad(loss, x, retain_graph=True)
            loss.backward()
            del loss
            hb = getattr(pool, "host_buffers", None)
            if hb is not None:
                seen.append((hb.allocations, hb.allocated_bytes, hb.taken_bytes, hb.lent_bytes()))
        out = [p.grad.clone() for l in layers for p in l.parameters()] + [x.grad.clone()]
        return (out + [gx] if retain else out), seen
    finally:
        eng.close()


def test_downloads_reuse_the_same_buffers_every_step_and_bytes_stay_bounded():
    """Before: every download allocated a fresh host tensor (on CUDA through the caching host
    allocator). Now the second and later steps allocate nothing: same storages, same bytes."""
    steps = 6
    pool = make_pool("fake_cuda", 2, stream_jitter_s=0.001, seed=2)
    _, seen = _steps(pool, steps)
    per_step = seen[0][2]  # bytes downloaded into lent buffers by one step
    assert all(b - a == per_step for a, b in zip([s[2] for s in seen], [s[2] for s in seen[1:]]))
    kept = seen[0][3]  # the activations the engine's last call still holds after its step
    assert per_step > 0 and kept > 0 and all(s[3] == kept for s in seen)
    # Held bytes: at most one step's downloads plus one earlier call's activations, whatever the
    # timing (before: a fresh buffer per download, steps x per_step bytes made).
    assert seen[-1][1] <= per_step + kept < steps * per_step
    assert pool.host_buffers.reuses >= (steps - 2) * seen[0][0]


def test_reused_buffers_give_the_cpu_backends_results_bit_for_bit_with_a_second_backward():
    ref, _ = _steps(make_pool("cpu", 2), 3, retain=True)
    pool = make_pool("fake_cuda", 2, stream_jitter_s=0.002, seed=4)
    got, seen = _steps(pool, 3, retain=True)
    assert pool.host_buffers.reuses > 0 and seen[-1][3] > 0  # buffers were reused while a call held some
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_download_buffers_are_pinned_at_their_exact_size_and_results_match():
    ref, _ = _steps(make_pool("cpu", 2), 3)
    pool = make_pool("cuda", 2, device_indices=[0, 0])  # two workers on one GPU
    got, seen = _steps(pool, 3)
    hb = pool.host_buffers
    assert hb.reuses > 0 and all(t.is_pinned() for q in hb._free.values() for t in q)
    assert pool.download_pinned_bytes == hb.allocated_bytes  # registered in place: no rounding
    assert all(torch.allclose(a, b.cpu(), rtol=1e-5, atol=1e-6) for a, b in zip(ref, got))
