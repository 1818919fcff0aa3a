"""The fake driver's page rule (roundpipe_lab/fake_cuda/cudart.py FakeCudart), answered from an index of page spans:
a registration touching a registered page fails with 712 whatever its neighbours, others succeed, and
an unregistered run frees its pages; thousands of runs cost O(log n) each, not a scan."""

import time

import pytest

from lightning_roundpipe.workers.pinning import ALREADY_REGISTERED, PAGE
from roundpipe_lab.fake_cuda.cudart import FakeCudart


@pytest.mark.timeout(30)
def test_registrations_touching_a_registered_page_fail_and_others_do_not():
    rt = FakeCudart()
    base = 1000 * PAGE
    assert rt.cudaHostRegister(base + 10, 2 * PAGE, 0) == 0  # pages 1000-1002
    assert rt.cudaHostRegister(base + 5 * PAGE, PAGE, 0) == 0  # page 1005
    for ptr, n in [(base - 1, 2), (base + 3 * PAGE - 1, 1), (base + 4 * PAGE, 2 * PAGE), (base + 5 * PAGE + 7, 1),
                   (base - PAGE, 10 * PAGE)]:
        assert rt.cudaHostRegister(ptr, n, 0) == ALREADY_REGISTERED, (ptr - base, n)
        assert rt.cudaGetLastError() == ALREADY_REGISTERED
    assert rt.cudaHostRegister(base + 3 * PAGE, PAGE, 0) == 0  # page 1003: free between the two
    assert rt.cudaHostRegister(base - PAGE, PAGE - 1, 0) == 0  # page 999
    assert rt.overlapping_calls == 5
    assert rt.cudaHostUnregister(base + 10) == 0
    assert rt.cudaHostUnregister(base + 10) == 713
    assert rt.cudaHostRegister(base + 100, PAGE, 0) == 0  # its pages are free again
    assert sorted(rt.pages) == sorted([base - PAGE, base + 100, base + 3 * PAGE, base + 5 * PAGE])


@pytest.mark.timeout(60)
def test_many_registrations_do_not_scan_every_run():
    rt = FakeCudart()
    t0 = time.perf_counter()
    for i in range(20000):
        assert rt.cudaHostRegister((2 * i) * PAGE, PAGE, 0) == 0
    assert rt.cudaHostRegister(3 * PAGE, PAGE, 0) == 0
    assert rt.cudaHostRegister(4 * PAGE + 1, 1, 0) == ALREADY_REGISTERED
    # A scan of every run per call would be 2e8 steps here (minutes); the index takes well under that.
    assert time.perf_counter() - t0 < 30
