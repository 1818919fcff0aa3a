"""The compile clock: seconds spent compiling, which no wait's timeout counts (``host/compile_clock.py``)."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_roundpipe.engine.layer_call import ModuleLock
from lightning_roundpipe.host.compile_clock import COMPILE_CLOCK, CompileClock, wait_excluding_compiles
from lightning_roundpipe.workers.completions import Completion, PipelineTimeout, TaskLabel


class FakeTime:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_overlapping_compiles_count_once_and_any_window_reads_its_share():
    now = FakeTime()
    clock = CompileClock(now)
    clock.started()  # 100: one compile
    now.t = 102.0
    clock.started()  # 102: a second one while the first runs (another worker's)
    now.t = 103.0
    clock.ended()
    now.t = 104.0
    clock.ended()  # 100-104: one interval, 4 s, not 4 + 1
    now.t = 110.0
    clock.started()
    now.t = 111.5
    assert clock.compiling() and clock.seconds() == 5.5  # the open interval counts up to now
    clock.ended()
    now.t = 120.0
    assert not clock.compiling()
    assert clock.seconds() == 5.5
    assert clock.seconds_between(101.0) == 4.5  # 3 of the first interval, all of the second
    assert clock.seconds_between(104.0, 110.0) == 0.0
    assert clock.seconds_between(103.0, 111.0) == 2.0
    assert clock.seconds_between(90.0, 100.0) == 0.0
    clock.ended()  # an end without a start (callbacks registered during a compile) changes nothing
    assert clock.seconds() == 5.5


def compile_for(seconds: float) -> threading.Thread:
    """A 'compile' of ``seconds`` on the process's clock, in a thread (as a worker's would run)."""

    def run():
        COMPILE_CLOCK.started()
        try:
            time.sleep(seconds)
        finally:
            COMPILE_CLOCK.ended()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(30)
def test_a_wait_ends_after_its_timeout_plus_the_compile_seconds_that_passed_meanwhile():
    never = threading.Event()
    t0 = time.monotonic()
    assert not wait_excluding_compiles(never.wait, 0.3)
    plain = time.monotonic() - t0
    compiling = compile_for(1.0)
    t0 = time.monotonic()
    assert not wait_excluding_compiles(never.wait, 0.3)
    extended = time.monotonic() - t0
    compiling.join()
    assert 0.3 <= plain < 1.0  # a hang outside a compile still fails on time
    assert extended >= 1.0 + 0.3 - 0.05  # the compile (less its start-up in the thread) did not count


@pytest.mark.timeout(30)
def test_a_host_wait_and_a_module_lock_outlast_a_compile_longer_than_their_timeout():
    """A completion set, and a module lock released, after a 1 s compile: waits of 0.3 s get them."""
    done = Completion(TaskLabel("forward", "F0", 0, 0, "compute"))
    lock = ModuleLock([0])
    lock.acquire(1.0, 0, 0, str)

    def worker():
        COMPILE_CLOCK.started()
        time.sleep(1.0)
        COMPILE_CLOCK.ended()
        time.sleep(0.05)
        done.set("out")
        lock.release()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    assert done.wait(0.3) == "out"
    lock.acquire(0.3, 1, 0, str)
    lock.release()
    thread.join()
    with pytest.raises(PipelineTimeout, match="timed out after 0.3s"):  # nothing compiles: on time
        Completion(TaskLabel("forward", "F0", 1, 0, "compute")).wait(0.3)
