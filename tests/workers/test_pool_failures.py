"""Failures of the worker pool, timed: a hung task, an interrupt, a task exception; on the CPU
backend and on the fake-stream backend. Every wait honours ``timeout``, the error names the task
that is really stuck, and no ``roundpipe-*`` thread is left once the work in flight has ended."""

import signal
import threading
import time

import pytest
import torch
from torch import nn

from lightning_roundpipe import EngineOptions, PipelineEngine, PipelineTimeout, WorkerError, simple_plan
from lightning_roundpipe.workers import make_pool

BACKENDS = ["cpu", "fake_cuda"]


class Hang(nn.Module):
    """Blocks its first call until released (a hung kernel or a deadlocked user layer)."""

    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.release = threading.Event()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            self.release.wait(30)
        return self.lin(x)


class Boom(nn.Linear):
    def forward(self, x):
        raise ValueError("boom in layer 3")


class Slow(nn.Linear):
    def forward(self, x):
        time.sleep(0.2)
        return super().forward(x)


def ours():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("roundpipe-"))


def wait_gone(limit_s):
    deadline = time.monotonic() + limit_s
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    return ours()


def build(backend, layers, timeout_s, microbatches=2):
    pool = make_pool(backend, 2, timeout_s=timeout_s)
    return PipelineEngine(layers, pool, simple_plan(len(layers), 2), EngineOptions(microbatches=microbatches))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hung_compute_fails_within_timeout_plus_one_second_naming_the_stuck_task(backend):
    torch.manual_seed(0)
    hang = Hang()
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), hang, nn.Linear(8, 8)]  # F0 = layers 0-1 (w0), F1 = 2-3 (w1)
    eng = build(backend, layers, timeout_s=2.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(PipelineTimeout) as info:
            with torch.no_grad():
                eng(torch.randn(4, 8))
        to_error = time.monotonic() - t0
        msg = str(info.value)
        t1 = time.monotonic()
        eng.close()
        close_s = time.monotonic() - t1
    finally:
        hang.release.set()
    assert to_error <= 2.0 + 1.0, f"hang to error took {to_error:.2f}s"
    assert close_s <= 1.5, f"shutdown with a stuck lane took {close_s:.2f}s"
    assert "stuck: [forward, stage F1, microbatch 0, worker 1, compute queue]" in msg, msg
    assert "no pending tasks" not in msg
    assert wait_gone(3.0) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_interrupt_stops_the_run_within_two_seconds(backend):
    layers = [Slow(8, 8) for _ in range(4)]
    eng = build(backend, layers, timeout_s=60.0, microbatches=8)
    main = threading.main_thread().ident
    sent = []

    def interrupt():
        sent.append(time.monotonic())
        signal.pthread_kill(main, signal.SIGINT)

    # Python's own handler (Ctrl+C raises KeyboardInterrupt), whatever an earlier test left: Lightning
    # ignores SIGINT after it handled an interrupt of fit, and that setting outlives the test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.6, interrupt)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with torch.no_grad():
                eng(torch.randn(16, 8))  # 2 stages x 8 microbatches x 2 layers x 0.2 s: about 3.4 s uninterrupted
        raised = time.monotonic()
        eng.close()
        assert raised - sent[0] <= 2.0, f"interrupt to stop took {raised - sent[0]:.2f}s"
        assert wait_gone(2.0) == []
        assert time.monotonic() - sent[0] <= 2.5
    finally:
        timer.cancel()
        eng.close()  # also when the assertions failed: no thread of this test outlives it
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("backend", BACKENDS)
def test_task_exception_leaves_no_thread(backend):
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), Boom(8, 8)]
    eng = build(backend, layers, timeout_s=10.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="boom in layer 3") as info:
        eng(torch.randn(4, 8)).sum().backward()
    assert time.monotonic() - t0 <= 2.0
    assert info.value.label.stage == "F1" and info.value.label.worker == 1
    eng.close()
    assert wait_gone(2.0) == []


def test_lane_timeout_names_the_task_waited_for_and_the_stuck_one():
    """A queued task whose input never arrives fails on its lane after ``timeout`` (not later)."""
    hang = Hang()
    layers = [nn.Linear(8, 8), hang, nn.Linear(8, 8), nn.Linear(8, 8)]
    pool = make_pool("cpu", 2, timeout_s=1.0)
    eng = PipelineEngine(layers, pool, simple_plan(4, 2), EngineOptions(microbatches=2))
    try:
        t0 = time.monotonic()
        with pytest.raises(PipelineTimeout) as info, torch.no_grad():
            eng(torch.randn(4, 8))
        assert time.monotonic() - t0 <= 2.0
        assert "stuck: [forward, stage F0, microbatch 0, worker 0, compute queue] running for" in str(info.value)
    finally:
        hang.release.set()
        eng.close()
    assert wait_gone(3.0) == []
