"""Issue 42: the fake CUDA driver behaves like CUDA where the worker defects hid, and each defect is
fixed. Every test here failed on commit 2c9c60c once the fake driver had the behaviour (the test's
docstring says how), and passes with the fix."""

import logging

import pytest
import torch

from lightning_roundpipe.workers import make_pool
from lightning_roundpipe.workers.pinning import PAGE


def _in_page(flat, page):
    """The index of the first float of ``flat`` (its own storage) in the ``page``-th page after its start's."""
    start = flat.data_ptr()
    return (start - start % PAGE + page * PAGE - start) // 4 + 1


# ------------------------------------------------------------------ 1. is_pinned from the storage start


@pytest.mark.timeout(30)
def test_is_pinned_answers_from_the_storage_start_as_aten_does():
    pool = make_pool("fake_cuda", 1)
    flat = torch.zeros(5 * PAGE // 4)
    head, far = flat[:10], flat[_in_page(flat, 2):_in_page(flat, 2) + 10]  # in its first and third pages
    try:
        assert pool.driver.register(far)
        assert not pool.driver.is_pinned(far)  # its own page is pinned, its storage's first page is not
        assert pool.driver.register(head)
        assert pool.driver.is_pinned(flat[_in_page(flat, 1):])  # its pages are not all pinned: still "pinned"
    finally:
        pool.shutdown()


@pytest.mark.timeout(30)
def test_views_reaching_past_a_pinned_first_page_are_pinned_and_nothing_warns_without_a_reason(caplog):
    """Two neighbouring tensors of one storage (16 KB, as flat masters): the first pins the storage's
    first page, the second starts in it and reaches past it. At 2c9c60c the second was refused, as a
    tensor "pinned by someone else" (ATen answers ``is_pinned`` from the storage start), with no
    reason counted: ``pin_uploads`` returned 400 of 16400 bytes and warned "...: " with no reason."""
    pool = make_pool("fake_cuda", 1)
    flat = torch.zeros(4100)
    first, second = flat[:100], flat[100:]
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_roundpipe"):
            assert pool.pin_uploads("register", [first, second]) == 16400
        assert "stay pageable" not in caplog.text
        assert pool.pageable_reasons == {}
        assert pool.driver.pins.covers(second) and pool.driver.pins.covers(first)
        pool.unpin()
        assert pool.driver.cudart.pages == {}
    finally:
        pool.shutdown()


@pytest.mark.timeout(30)
def test_a_tensor_pinned_by_torchs_host_allocator_counts_as_pinned_and_a_refusal_always_has_a_reason(caplog):
    """Memory pinned by someone else is pinned (no registration); a refused one names its reason."""
    from lightning_roundpipe.workers.pinning import FakeCudart

    rt = FakeCudart()
    pool = make_pool("fake_cuda", 1, cudart=rt)
    elsewhere = torch.zeros(2 * PAGE // 4)
    assert rt.cudaHostRegister(elsewhere.data_ptr(), 2 * PAGE, 0) == 0  # as torch's pinned host allocator
    rt.fail_with = 2
    pageable = torch.randn(3000)
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_roundpipe"):
            assert pool.pin_uploads("register", [elsewhere, pageable]) == 2 * PAGE
        assert pool.driver.is_pinned(elsewhere)
        assert "cudaHostRegister failed with CUDA error 2: 1" in caplog.text
        assert not caplog.text.rstrip().endswith(":")
    finally:
        pool.shutdown()


# ------------------------------------------------------------------ 2. current_stream: a new object per call


def _downloads(pool, n):
    from lightning_roundpipe.workers import TaskLabel

    w = pool.workers[0]
    src = torch.randn(64)
    done = [w.submit("download", lambda: pool.copy_to_host(w, [src]), [], TaskLabel("act_out", "F0", i, 0, "download"))
            for i in range(n)]  # all queued at once: many copies in flight, as in a step
    assert all(torch.equal(c.wait(10)[0], src) for c in done)


@pytest.mark.timeout(60)
def test_current_stream_is_a_new_object_per_call_equal_to_the_lanes_stream():
    pool = make_pool("fake_cuda", 1).start()
    try:
        seen = []
        lane = pool.workers[0].lanes["download"]
        from lightning_roundpipe.workers import TaskLabel

        c = pool.workers[0].submit("download", lambda: seen.extend(pool.driver.current_stream(None) for _ in range(2)),
                                   [], TaskLabel("act_out", "F0", 0, 0, "download"))
        c.wait(10)
        assert seen[0] is not seen[1] and seen[0] == seen[1] == lane.stream and hash(seen[0]) == hash(lane.stream)
    finally:
        pool.shutdown()


@pytest.mark.timeout(60)
def test_repeated_downloads_do_not_grow_the_stream_holds():
    """At 2c9c60c ``copy_to_host`` keyed its holds by ``id(current_stream())``: 200 downloads left
    200 queues in ``StreamHolds`` (never removed, each scanned by every task's ``collect``)."""
    pool = make_pool("fake_cuda", 1).start()
    try:
        _downloads(pool, 200)
        pool.synchronize()
        assert pool.holds.held == 0
        assert pool.holds.queue_count <= 3  # one per lane's stream at most
    finally:
        pool.shutdown()
