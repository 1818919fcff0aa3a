"""The optimizer lane runs waiting layer updates lowest layer first, and other work after them in
submission order (``optim/host_lane.py``)."""

import threading

import pytest
import torch

from lightning_roundpipe.optim.host_lane import HostLane
from lightning_roundpipe.tracing.records import TraceRecorder
from lightning_roundpipe.workers.completions import TaskLabel


@pytest.mark.timeout(30)
def test_waiting_layer_updates_run_lowest_layer_first_and_other_work_after_them():
    lane = HostLane(TraceRecorder(), name="roundpipe-optim-order-test")
    ran, gate = [], threading.Event()
    try:
        blocker = lane.submit(lambda: gate.wait(10), TaskLabel("optim", "busy"))
        # While the lane is busy: updates arrive last layer first (as backward completes them),
        # with bookkeeping between them.
        work = [lane.submit(lambda: ran.append("commit"), TaskLabel("undo", "commit"), traced=False)]
        for layer in (5, 3, 4, 0):
            work.append(lane.submit(lambda layer=layer: ran.append(layer), TaskLabel("optim", f"L{layer}"), layer=layer))
        work.append(lane.submit(lambda: ran.append("restore"), TaskLabel("undo", "restore"), traced=False))
        assert lane.has_waiting()
        gate.set()
        for c in [blocker] + work:
            c.wait(10)
        assert ran == [0, 3, 4, 5, "commit", "restore"]
        assert not lane.has_waiting()
        # Alone, a later update still runs after the work already running or done.
        after = lane.submit(lambda: ran.append(1), TaskLabel("optim", "L1"), layer=1)
        after.wait(10)
        assert ran[-1] == 1
    finally:
        lane.close()
    assert "roundpipe-optim-order-test" not in [t.name for t in threading.enumerate()]


@pytest.mark.timeout(30)
def test_a_failing_update_fails_its_completion_and_the_lane_goes_on():
    lane = HostLane(TraceRecorder())
    try:
        bad = lane.submit(lambda: 1 / 0, TaskLabel("optim", "L2"), layer=2)
        good = lane.submit(lambda: torch.ones(2).sum().item(), TaskLabel("optim", "L3"), layer=3)
        with pytest.raises(Exception, match="ZeroDivisionError"):
            bad.wait(10)
        assert good.wait(10) == 2.0
    finally:
        lane.close()
