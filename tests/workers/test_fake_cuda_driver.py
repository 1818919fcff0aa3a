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
