"""A layer that never returns: the fit times out, and a new fit in the same process does not wait for it.

Issue 20, item 13: the stuck layer's thread held the CPU generator gate (``engine/rng.py``),
whose waits had no timeout, so the next fit blocked until that layer returned. Now every wait of
the gate (and of the per-module layer lock) is bounded and names who holds it, and closing an
engine gives up the holds of its lanes still stuck inside a task.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from _exact_models import WEIGHT_TOL, our_threads
from _models import SeqModule, fit, weight_error, weights
from lightning_roundpipe import PipelineTimeout, RoundPipeStrategy
from lightning_roundpipe.engine.layer_call import ModuleLock
from lightning_roundpipe.engine.rng import CpuGeneratorGate

SECOND_FIT_TIMEOUT_S = 10.0


class Hang(nn.Module):
    """Blocks on ``release`` in its ``hang_at``-th call (0: the first, which runs seeded and
    exclusive; 2: a later one, which runs shared, the layer being known not to draw)."""

    def __init__(self, release: threading.Event, hang_at: int):
        super().__init__()
        self.release, self.hang_at, self.calls = release, hang_at, 0

    def forward(self, x):
        call, self.calls = self.calls, self.calls + 1
        if call == self.hang_at:
            self.release.wait(120)  # "forever": until the test ends
        return x


class Hanging(SeqModule):
    def __init__(self, release, hang_at):
        super().__init__()
        self.net = nn.Sequential(*self.net[:2], Hang(release, hang_at), *self.net[2:])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("hang_at", [0, 2])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_fit_after_a_hung_one_completes_in_time_and_exact(hang_at, opt):
    threads_before = our_threads()
    release = threading.Event()
    try:
        t0 = time.monotonic()
        with pytest.raises(PipelineTimeout, match="timed out after 2s"):
            # split_check=False: the check (on by default since b598225) calls every layer on the host before the
            # first step; Hang's call counter is per-call state it rightly refuses (SplitInvarianceError, not the
            # timeout under test), and with hang_at=0 its host call would be the one that hangs
            fit(Hanging(release, hang_at), RoundPipeStrategy(microbatches=2, timeout=2, split_check=False), devices=2,
                max_steps=3)
        assert time.monotonic() - t0 < 10

        ref = SeqModule(opt=opt)
        w0 = weights(ref)
        fit(ref, "auto", max_steps=3, record_grads=False)
        module = SeqModule(opt=opt)
        t1 = time.monotonic()
        fit(module, RoundPipeStrategy(microbatches=2, timeout=SECOND_FIT_TIMEOUT_S), devices=2, max_steps=3,
            record_grads=False)
        assert time.monotonic() - t1 < SECOND_FIT_TIMEOUT_S
        assert weight_error(weights(module), weights(ref), w0) < WEIGHT_TOL
        state = torch.get_rng_state()
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while our_threads() != threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert our_threads() == threads_before  # the stuck lane ended once its layer returned ...
    assert torch.equal(torch.get_rng_state(), state)  # ... and did not set the generator back as it left


def _hold_in_thread(gate: CpuGeneratorGate, owner, inside: threading.Event, leave: threading.Event, out: dict):
    def run():
        with gate.exclusive((3, 1, "Stuck"), 10, owner, lambda: "task [forward, stage F1, microbatch 1, worker 0]") \
                as hold:
            out["found"] = torch.get_rng_state()
            hold.saved = out["found"]
            torch.manual_seed(1234)  # the seeded layer's own state
            inside.set()
            leave.wait(10)
            out["put_back"] = gate.put_back(hold, out["found"])

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(10)
    return thread


@pytest.mark.timeout(30)
def test_gate_waits_are_bounded_and_name_the_holder():
    gate = CpuGeneratorGate()
    inside, leave, out = threading.Event(), threading.Event(), {}
    holder = _hold_in_thread(gate, object(), inside, leave, out)
    try:
        t0 = time.monotonic()
        with pytest.raises(PipelineTimeout) as info:
            with gate.exclusive((5, 0, "Linear"), 0.3, None, lambda: "task [forward, stage F2, microbatch 0, worker 1]"):
                pass
        assert 0.3 <= time.monotonic() - t0 < 2
        assert str(info.value).startswith(
            "layer 5 (Linear), microbatch 0 (task [forward, stage F2, microbatch 0, worker 1]) timed out after 0.3s "
            "waiting for torch's CPU generator, held by layer 3 (Stuck), microbatch 1 (task [forward, stage F1, "
            "microbatch 1, worker 0])")
        with pytest.raises(PipelineTimeout, match=r"layer 6 \(Tanh\), microbatch 2 \(thread MainThread\) timed out"):
            gate.enter_shared((6, 2, "Tanh"), 0.2)
    finally:
        leave.set()
        holder.join(10)
    assert out["put_back"] is True
    with gate.exclusive("after", 1):  # the timed-out requests left nothing behind
        pass


@pytest.mark.timeout(30)
def test_abandoning_a_pool_frees_the_gate_and_puts_back_the_state_its_holder_found():
    gate = CpuGeneratorGate()
    pool = object()
    torch.manual_seed(7)
    found = torch.get_rng_state()
    inside, leave, out = threading.Event(), threading.Event(), {}
    holder = _hold_in_thread(gate, pool, inside, leave, out)
    try:
        assert gate.abandon(object()) == []  # another pool's: nothing
        assert gate.abandon(pool) == ["layer 3 (Stuck), microbatch 1 (task [forward, stage F1, microbatch 1, worker 0])"]
        assert torch.equal(torch.get_rng_state(), found)
        with gate.exclusive("a new call", 1):  # no wait for the stuck thread
            torch.manual_seed(99)
            mine = torch.get_rng_state()
        shared = gate.enter_shared((0, 0, "A"), 1)  # shared ones get in too
    finally:
        leave.set()
        holder.join(10)
    assert out["put_back"] is False  # the stuck thread, leaving at last, did not touch the generator
    assert torch.equal(torch.get_rng_state(), mine)
    assert gate.exit_shared(shared) == []


@pytest.mark.timeout(30)
def test_abandoning_shared_holders_ends_their_period_without_their_draws():
    gate = CpuGeneratorGate()
    pool = object()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    stuck = gate.enter_shared((1, 0, "Stuck"), 1, pool)
    torch.rand(2)  # an unseeded draw while it is inside
    assert gate.abandon(pool) == ["layer 1 (Stuck), microbatch 0 (thread MainThread)"]
    assert torch.equal(torch.get_rng_state(), before)  # the draw is not kept
    with gate.exclusive("a seeded call", 0.5):  # not kept out by the abandoned shared holder
        pass
    assert gate.exit_shared(stuck) == []  # its late exit changes nothing


@pytest.mark.timeout(30)
def test_module_lock_wait_is_bounded_and_names_the_running_call():
    lock = ModuleLock([2, 5])
    names = {threading.current_thread(): "task [backward, stage B1, microbatch 0, worker 1, compute queue]"}
    held, leave = threading.Event(), threading.Event()

    def run():
        names[threading.current_thread()] = "task [forward, stage F0, microbatch 1, worker 0, compute queue]"
        lock.acquire(5, 2, 1, names.get)
        held.set()
        leave.wait(10)
        lock.release()

    thread = threading.Thread(target=run)
    thread.start()
    assert held.wait(10)
    try:
        with pytest.raises(PipelineTimeout) as info:
            lock.acquire(0.2, 5, 0, names.get)
        assert str(info.value).startswith(
            "layer 5, microbatch 0 (task [backward, stage B1, microbatch 0, worker 1, compute queue]) timed out after "
            "0.2s waiting for its module (shared by layers 2, 5), which layer 2, microbatch 1 (task [forward, stage F0, "
            "microbatch 1, worker 0, compute queue]) is running")
    finally:
        leave.set()
        thread.join(10)
    lock.acquire(1, 5, 0, names.get)  # free again
    lock.release()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_layer_that_hangs_in_the_split_check_fails_the_fit_in_time_naming_it(opt):
    # issue 43's split-invariance check runs every layer on the host before the first step; it used to wait for
    # a hung layer forever. With the runtime's timeout it fails as a hung worker task does, naming the layer.
    threads_before = our_threads()
    release = threading.Event()
    module = Hanging(release, hang_at=0)  # its first call is the check's whole-batch call on the host
    module.opt = opt
    w0 = weights(module)
    try:
        t0 = time.monotonic()
        with pytest.raises(PipelineTimeout) as info:
            fit(module, RoundPipeStrategy(microbatches=2, timeout=2), devices=2, max_steps=3)
        assert time.monotonic() - t0 < 10
        assert str(info.value).startswith(
            "RoundPipeStrategy(split_check=True): pipelined layer 2 (`net.2`, Hang) did not return within 2s from "
            "its whole-batch call on the host")
        assert "raise timeout; split_check=False skips the check" in str(info.value)
        assert all(torch.equal(w, w0[k]) for k, w in weights(module).items())
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while our_threads() != threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert our_threads() == threads_before  # the check's thread ended once the layer returned
