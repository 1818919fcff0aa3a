"""The emulated-GPU benchmark's measuring pieces: which thread is which part of the host, the phase
clock's hooks (timed while entered, the original functions back afterwards), the wake-up hook."""

import time

import pytest

from benchmarks.validation.emulated_gpus import PhaseClock, lane_wakeups, thread_group


def test_threads_are_grouped_by_the_names_the_pool_gives_them():
    assert [thread_group(n) for n in ("MainThread", "roundpipe-stream-w3-compute", "roundpipe-w12-upload",
                                      "roundpipe-optim", "Thread-7")] == ["dispatch", "streams", "lanes",
                                                                          "optimizer", "other"]


@pytest.mark.timeout(60)
def test_the_phase_clock_times_undo_and_accumulation_and_puts_the_functions_back(monkeypatch):
    from lightning_roundpipe.engine import step as engine_step
    from lightning_roundpipe.optim.step_undo import StepUndo

    def busy_accumulate(*args):
        deadline = time.thread_time() + 0.02
        while time.thread_time() < deadline:  # CPU time of this thread, what the clock counts
            pass
        return args

    monkeypatch.setattr(engine_step, "accumulate_host_grads", busy_accumulate)
    originals = (StepUndo.save, StepUndo.commit, busy_accumulate)

    class Undo:  # what StepUndo.commit reads and writes
        saved = ["a before-image"]

    undo = Undo()
    with PhaseClock() as clock:
        assert StepUndo.commit is not originals[1]
        StepUndo.commit(undo)
        assert engine_step.accumulate_host_grads(1, 2) == (1, 2)
    assert not undo.saved  # the original ran: the step's before-images are let go
    assert (StepUndo.save, StepUndo.commit, engine_step.accumulate_host_grads) == originals
    assert clock.seconds["accumulate"] >= 0.02 and clock.seconds["undo"] < 0.02


def test_lane_wakeups_reads_the_pools_lane_counters():
    from lightning_roundpipe.workers import TaskLabel, make_pool

    pool = make_pool("cpu", 1).start()
    try:
        before = lane_wakeups(pool)
        pool.workers[0].compute(lambda: None, (), TaskLabel("forward", "F0", 0, 0, "compute")).wait(10)
        pool.drain(10)
        done = lane_wakeups(pool) - before
    finally:
        pool.shutdown()
    assert done.tasks_run == 1 and done.wakeups >= 1


@pytest.mark.timeout(30)
def test_the_undo_charge_sleeps_per_parameter_copied_once_and_puts_capture_back():
    import torch

    from benchmarks.validation.emulated_gpus import UndoCharge
    from lightning_roundpipe.optim.step_undo import StepUndo

    p = torch.nn.Parameter(torch.ones(1000))
    undo = StepUndo(torch.optim.SGD([p], lr=0.1))
    original = StepUndo.capture
    with UndoCharge(2e-5) as charge:  # 1,000 parameters: 0.02 s
        t0 = time.perf_counter()
        StepUndo.capture(undo, [p])
        StepUndo.capture(undo, [p])  # already captured: nothing copied, nothing charged
        took = time.perf_counter() - t0
    assert StepUndo.capture is original
    assert charge.charged_s == pytest.approx(0.02)
    assert took >= 0.02
    assert torch.equal(undo.saved[id(p)][1], torch.ones(1000))  # the real before-image was taken too
