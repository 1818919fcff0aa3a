"""Issue 22 item 4, on the fake streams: pinning errors checked, cleared and counted, no page
registered twice; the download-buffer pool bounded, and never lending a buffer whose copy is
still in flight; frees ordered by events, not ``record_stream``."""

import random
import threading
import time

import pytest
import torch
from torch import nn

from lightning_roundpipe import EngineOptions, PipelineEngine, Plan
from lightning_roundpipe.workers import TaskLabel, make_pool
from lightning_roundpipe.workers.pinning import PAGE
from roundpipe_lab.fake_cuda.cudart import FakeCudart

MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation: the host could not lock more memory


def _download(pool, worker, tensors, tag):
    """Submit a reusable download of ``tensors`` on ``worker`` and return its host buffers as soon
    as the copy was *issued* (before it landed, as a failed step's bookkeeping holds them)."""
    w = pool.workers[worker]
    c = w.submit("download", lambda: pool.copy_to_host(w, tensors, reusable=True), [],
                 TaskLabel("act_out", "F0", tag, worker, "download"))
    deadline = time.monotonic() + 10
    while not c.is_set() and time.monotonic() < deadline:
        time.sleep(0.001)
    return c, c.value


@pytest.mark.timeout(30)
def test_failed_registrations_are_cleared_counted_and_leave_the_tensors_pageable(caplog):
    rt = FakeCudart(fail_with=MEMORY_ALLOCATION)
    pool = make_pool("fake_cuda", 1, cudart=rt)
    tensors = [torch.randn(3000) for _ in range(3)]
    try:
        with caplog.at_level("WARNING", logger="lightning_roundpipe"):
            assert pool.pin_uploads("register", tensors) == 0
        assert f"pinned='register': 36000 bytes the uploads read stay pageable (their copies are synchronous): " \
               f"cudaHostRegister failed with CUDA error {MEMORY_ALLOCATION}: 3" in caplog.text
        assert rt.last_error == 0  # cleared: a later kernel-launch check would report it as its own
        assert pool.pageable_reasons == {f"cudaHostRegister failed with CUDA error {MEMORY_ALLOCATION}": 3}
        assert not any(pool.driver.is_pinned(t) for t in tensors)
    finally:
        pool.shutdown()


@pytest.mark.timeout(30)
def test_small_tensors_sharing_pages_are_pinned_without_registering_any_page_twice():
    """Before: each tensor was registered at its own byte range; the second of two tensors on one
    page fails "already registered" (712) on CUDA, stays pageable, and leaves the error set."""
    rt = FakeCudart()
    pool = make_pool("fake_cuda", 1, cudart=rt)
    flat = torch.zeros(40 * 100)
    small = [flat[i * 100:(i + 1) * 100] for i in range(40)]  # 400 bytes each: ~10 to a page
    try:
        assert pool.pin_uploads("register", small) == 40 * 400
        assert rt.overlapping_calls == 0 and rt.last_error == 0 and pool.pageable_reasons == {}
        assert all(pool.driver.is_pinned(t) for t in small)
        assert rt.register_calls <= -(-40 * 400 // PAGE) + 1  # one call per uncovered run of pages
        pool.unpin()
        assert rt.pages == {}  # every run unregistered once its last tensor went
    finally:
        pool.shutdown()


@pytest.mark.timeout(60)
def test_pinned_download_bytes_stay_bounded_over_steps_of_varying_shapes():
    """Dynamic padding: every step downloads a new sequence length. Before: the pool kept a buffer
    of every shape it ever lent, pinned, so pinned bytes grew every step."""
    cap = 256 << 10
    pool = make_pool("fake_cuda", 1).start()
    pool.host_buffers.cap_bytes = cap
    rng = random.Random(0)
    pinned = []
    try:
        for step in range(20):
            seq = rng.randrange(8, 64)
            tensors = [torch.randn(4, seq, 32) for _ in range(3)] + [torch.randn(32, 32)]
            c, bufs = _download(pool, 0, tensors, step)
            got = c.wait(10)
            assert all(torch.equal(a, b) for a, b in zip(got, tensors))
            assert all(b.data_ptr() % PAGE == 0 for b in bufs)  # each owns its pages: pinned alone
            pool.release_host(bufs)
            pinned.append(pool.download_pinned_bytes)
        assert max(pinned) <= cap and pool.host_buffers.allocated_bytes <= cap
        assert pool.host_buffers.evictions > 0 and pool.host_buffers.reuses >= 19  # the (32, 32) buffer stays
        assert len(pool.driver.pins.registered_runs) == pool.host_buffers.free_count  # evicted ones unpinned
    finally:
        pool.shutdown()


@pytest.mark.timeout(30)
def test_a_buffer_handed_back_before_its_copy_landed_is_not_lent_again_until_it_has():
    """After a timeout the engine cancels the queues and the step's buffers go back to the pool at
    once (``StepRun.lent_buffers``), while the stream may still be copying into them. Here a copy
    lands 0.4 s after the work that issued it (``copy_delay_s``); before, the next download (on
    another worker's stream) was lent that very buffer while the copy was still going to write it."""
    pool = make_pool("fake_cuda", 2).start()
    pool.driver.copy_delay_s = 0.4
    try:
        c1, (first,) = _download(pool, 0, [torch.full((256,), 7.0)], 0)
        assert not c1.device_event.query()  # the copy is still in flight
        pool.release_host([first])  # what a failed step does
        c2, (second,) = _download(pool, 1, [torch.full((256,), 3.0)], 1)
        assert second is not first
        assert c2.wait(10)[0].eq(3.0).all() and c1.wait(10)[0].eq(7.0).all()
        pool.release_host([second])
        _, (third,) = _download(pool, 1, [torch.zeros(256)], 2)
        assert third is first or third is second  # once landed, buffers are lent again
    finally:
        pool.shutdown()


@pytest.mark.timeout(60)
def test_gradients_equal_the_cpu_backends_when_every_download_lands_late():
    """Copies that land after the work that issued them (as non-blocking copies on a GPU): every
    host read and every reuse of a buffer must wait for the copy's event, or results differ."""
    from test_fake_streams import PLANS, engine_grads

    for plan in PLANS[:2]:
        ref = engine_grads("cpu", plan, 3)
        got = engine_grads("fake_cuda", plan, 3, stream_jitter_s=0.001, seed=1, copy_delay_s=0.003)
        assert all(torch.equal(a, b) for a, b in zip(ref, got))


class _Slow(nn.Linear):
    def forward(self, x):
        time.sleep(0.15)
        return super().forward(x)


class _Gated(nn.Linear):
    def __init__(self, n, gate):
        super().__init__(n, n)
        self.gate = gate

    def forward(self, x):
        assert self.gate.wait(20), "the test never opened the gate"
        return super().forward(x)


@pytest.mark.timeout(60)
def test_a_stages_weights_are_freed_when_its_last_compute_completes_without_record_stream():
    """One worker runs F0 then F1. F1's first microbatch is queued on the compute stream (held at a
    gate) when F0's last compute finishes. Before: the weights were marked with ``record_stream``,
    so when F0's release freed them the allocator held their memory until the compute stream had
    run everything queued at that moment: F1's microbatches (the fake driver counts it as CUDA's
    allocator would). Now nothing is marked and the memory is free as soon as F0 is done."""
    gate = threading.Event()
    layers = [_Slow(16, 16), _Gated(16, gate)]
    pool = make_pool("fake_cuda", 1)
    eng = PipelineEngine(layers, pool, Plan(2, [(0, 1), (1, 2)], [(0, 2)]), EngineOptions(microbatches=2))
    f1_bytes = sum(p.numel() * p.element_size() for p in layers[1].parameters())
    out = {}

    def call():
        with torch.no_grad():
            out["y"] = eng(torch.randn(4, 16))

    t = threading.Thread(target=call, daemon=True)
    try:
        t.start()
        memory = pool.workers[0].memory
        deadline = time.monotonic() + 15
        while memory.weight_bytes != f1_bytes and time.monotonic() < deadline:
            time.sleep(0.002)
        assert memory.weight_bytes == f1_bytes  # F0 released while F1 waits at the gate
        time.sleep(0.05)
        held = pool.driver.stream_held_bytes()
        assert not gate.is_set() and held == 0, f"{held} bytes of F0's weights held behind F1's queued work"
        assert pool.driver.record_stream_calls == 0
        assert pool.holds.held >= 1  # instead: F1's queued computes hold the inputs they will read
    finally:
        gate.set()
        t.join(20)
    try:
        assert out["y"].shape == (4, 16)
        pool.synchronize()
        assert pool.holds.held == 0  # every reader done: nothing held
    finally:
        eng.close()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(60)
def test_cuda_pins_tensors_sharing_pages_and_leaves_no_error_set():
    """On a GPU: small tensors ~10 to a page are all pinned (CUDA would refuse a second
    registration of a page), and no failed call leaves CUDA's last error set on this thread."""
    pool = make_pool("cuda", 1)
    flat = torch.zeros(40 * 100)
    small = [flat[i * 100:(i + 1) * 100] for i in range(40)]
    try:
        assert pool.pin_uploads("register", small) == 40 * 400
        assert all(t.is_pinned() for t in small) and pool.pageable_reasons == {}
        assert pool.driver.pins.cudart.cudaGetLastError() == 0
        torch.ones(4, device="cuda").sum().item()  # a launch after pinning reports no stale error
    finally:
        pool.shutdown()
    assert not flat.is_pinned()  # unregistered with the pool


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_training_steps_mark_no_tensor_with_record_stream_and_match_the_cpu_backend():
    from _models import mlp
    from lightning_roundpipe import simple_plan

    def grads(backend, **kw):
        layers = mlp(depth=4, width=16, dropout=0.0, seed=3)
        pool = make_pool(backend, 2, **kw)
        eng = PipelineEngine(layers, pool, simple_plan(4, 2), EngineOptions(microbatches=3))
        g = torch.Generator().manual_seed(5)
        try:
            for _ in range(3):
                (eng(torch.randn(6, 16, generator=g)) ** 2).mean().backward()
            return [p.grad.clone() for l in layers for p in l.parameters()], pool
        finally:
            eng.close()

    ref, _ = grads("cpu")
    got, pool = grads("cuda", device_indices=[0, 0], stream_jitter_cycles=20000, seed=1)
    assert pool.driver.record_stream_calls == 0
    assert all(torch.allclose(a, b.cpu(), rtol=1e-5, atol=1e-6) for a, b in zip(ref, got))
