"""Lanes wait on events, not polls (``Lane``): a task waiting for device work that is issued but
unfinished is not looked at again until the device reports it, wake-ups are bounded by the tasks
that became runnable, and each look examines at most one task however many are pending. Counted
with ``WorkerPool.lane_counters``. Also: the CUDA event waiter's order, and the intra-op threads
each backend gives its lanes."""

import threading
import time

import pytest
import torch

from lightning_roundpipe.workers import LaneCounters, TaskLabel, make_pool
from lightning_roundpipe.workers.event_waiter import EventWaiters, StreamEventWaiter


def label(kind, queue, mb=0, worker=0):
    return TaskLabel(kind, "F0", mb, worker, queue)


def settle(pool, looks, limit_s=5.0):
    """The counters once the lanes made ``looks`` looks (a lane looks again just after each task)."""
    deadline = time.monotonic() + limit_s
    while pool.lane_counters().looks < looks and time.monotonic() < deadline:
        time.sleep(0.01)
    return pool.lane_counters()


@pytest.mark.timeout(30)
def test_a_task_waiting_for_unfinished_device_work_is_not_looked_at_until_the_device_reports_it():
    pool = make_pool("fake_cuda", 1, timeout_s=30).start()
    release = threading.Event()
    try:
        w = pool.workers[0]
        time.sleep(0.05)  # every lane reaches its idle wait
        pool.reset_lane_counters()
        kernel = w.submit("compute", lambda: release.wait(5) and 1, [], label("forward", "compute"))
        copy = w.submit("download", lambda: 2, [kernel], label("act_out", "download"))
        while not kernel.is_set():  # issued: set at issue time, its device work (the "kernel") still runs
            time.sleep(0.005)
        during = settle(pool, looks=2)
        time.sleep(0.3)  # the old lanes looked again every 0.5 ms here: ~600 looks
        assert pool.lane_counters() == during
        assert not copy.is_set()
        # The compute lane woke once for the kernel and looked twice (ran it; nothing more); the
        # download lane has not woken at all.
        assert (during.wakeups, during.looks, during.tasks_run, during.device_notifications) == (1, 2, 1, 0)
        release.set()
        assert copy.wait(5) == 2
        after = settle(pool, looks=4)
        # The device event's completion woke the download lane once: it ran the copy, looked once more.
        assert (after.wakeups, after.looks, after.tasks_run, after.device_notifications) == (2, 4, 2, 1)
        assert after.tasks_examined == 2  # one task examined per look that found one
    finally:
        release.set()
        pool.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["cpu", "fake_cuda"])
def test_wake_ups_are_bounded_by_completions_with_hundreds_of_pending_tasks(backend):
    """2 workers, 300 chained upload -> compute -> download triples queued at once (transfers at
    mixed priorities, worker 1's uploads wait for worker 0's downloads): every lane wakes at most
    once per task it runs, and no look examines more than one pending task."""
    extra = dict(stream_jitter_s=2e-4, seed=3) if backend == "fake_cuda" else {}
    pool = make_pool(backend, 2, timeout_s=30, **extra).start()
    try:
        time.sleep(0.05)
        pool.reset_lane_counters()
        n = 150
        outs = []
        for i in range(n):
            prev = None
            for w in pool.workers:
                deps = [prev] if prev is not None else []
                up = w.submit("upload", lambda i=i: i, deps, label("act_in", "upload", i, w.index), priority=i % 3)
                comp = w.submit("compute", lambda: None, [up], label("forward", "compute", i, w.index))
                prev = w.submit("download", lambda i=i: i, [comp], label("act_out", "download", i, w.index),
                                priority=-(i % 2))
            outs.append(prev)
        assert [o.wait(30) for o in outs] == list(range(n))
        pool.drain()
        c = pool.lane_counters()
        tasks = 2 * 3 * n
        assert c.tasks_run == tasks
        assert c.wakeups <= tasks, c
        assert c.tasks_examined <= c.looks <= c.wakeups + tasks, c
        assert c.bookkeeping_s > 0
    finally:
        pool.shutdown()


def test_lane_counters_subtract_for_an_interval():
    a = LaneCounters(wakeups=5, looks=9, tasks_run=4, bookkeeping_s=0.5)
    b = LaneCounters(wakeups=2, looks=3, tasks_run=1, bookkeeping_s=0.25)
    assert a - b == LaneCounters(wakeups=3, looks=6, tasks_run=3, bookkeeping_s=0.25)


class _RawEvent:
    def __init__(self):
        self.done = threading.Event()

    def synchronize(self):
        self.done.wait(5)


class _Event:
    """Stands for a ``CudaEvent``: ``raw.synchronize`` blocks until ``finish``."""

    def __init__(self, order, stream=None):
        self.raw = _RawEvent()
        self.order = order
        self.stream = stream

    def query(self):
        return self.raw.done.is_set()

    def block(self):  # as ``CudaEvent.block``
        self.raw.synchronize()

    def finish(self):
        self.raw.done.set()


@pytest.mark.timeout(10)
def test_the_cuda_stream_waiter_calls_back_in_the_order_its_stream_completes_events():
    waiter = StreamEventWaiter("roundpipe-test-waiter")
    called = []
    first, second = _Event(order=1), _Event(order=2)
    try:
        waiter.add(second, lambda: called.append("second"))  # registered before the earlier-recorded one
        waiter.add(first, lambda: called.append("first"))
        time.sleep(0.05)
        assert called == []
        first.finish()  # the stream reached the first event: only its callback comes
        deadline = time.monotonic() + 2
        while called != ["first"] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert called == ["first"]
        second.finish()
        while len(called) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert called == ["first", "second"]
    finally:
        waiter.stop()
        assert waiter.join(2)


@pytest.mark.timeout(10)
def test_the_cuda_waiters_one_thread_per_stream_and_none_after_close():
    waiters = EventWaiters()
    streams = (object(), object())
    events = [_Event(order=i, stream=streams[i % 2]) for i in range(4)]
    called = []
    for e in events:
        assert waiters.add(e, lambda e=e: called.append(e.order))
    names = lambda: sorted(t.name for t in threading.enumerate() if t.name.startswith("roundpipe-event-waiter"))
    assert len(names()) == 2  # one per stream
    events[1].finish()  # stream 1's first: reported although stream 0 has not moved
    deadline = time.monotonic() + 2
    while called != [1] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert called == [1]
    for e in events:
        e.finish()
    while len(called) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sorted(called) == [0, 1, 2, 3]
    waiters.close(2)
    assert names() == []
    assert waiters.add(_Event(order=9, stream=streams[0]), lambda: None) is False  # closed: the caller polls


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend,options,expected", [
    ("cpu", {}, {"upload": 1, "compute": 1, "download": 1}),
    ("cpu", {"threads_per_worker": 2}, {"upload": 1, "compute": 2, "download": 1}),
    ("fake_cuda", {}, {"upload": 1, "compute": 1, "download": 1}),  # the stream executors run the work
])
def test_each_backend_sets_its_lanes_intra_op_threads_explicitly(backend, options, expected):
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # a new thread would inherit this unless the lane sets its own
    try:
        pool = make_pool(backend, 1, timeout_s=10, **options).start()
    finally:
        torch.set_num_threads(before)
    try:
        w = pool.workers[0]
        got = {q: w.submit(q, torch.get_num_threads, [], label("act_in", q)) for q in expected}
        assert {q: c.wait(10) for q, c in got.items()} == expected
    finally:
        pool.shutdown()


class _TorchCudaEvent:
    """Stands for ``torch.cuda.Event`` on a machine without CUDA: completes when the test says."""

    def __init__(self, enable_timing=False, blocking=False):
        self.done = threading.Event()

    def record(self, stream):
        pass

    def query(self):
        return self.done.is_set()

    def synchronize(self):
        self.done.wait(5)


@pytest.mark.timeout(10)
def test_cuda_host_waits_and_lane_notifications_go_through_the_stream_waiter(monkeypatch):
    from lightning_roundpipe.workers.cuda_streams import CudaStreams

    monkeypatch.setattr(torch.cuda, "Event", _TorchCudaEvent)
    drv = CudaStreams()
    stream = object()
    ev = drv.new_event()
    ev.record(stream)
    told = threading.Event()
    assert drv.when_done(ev, told.set)  # pending: the waiter will call back
    assert ev.wait(0.05) is False  # a bounded host wait that times out
    threading.Timer(0.05, ev.raw.done.set).start()
    assert ev.wait(2) is True and told.wait(2)
    assert drv.when_done(ev, lambda: None) is False  # done now: no call, the lane goes on
    drv.close(2)
    late = drv.new_event()
    late.record(stream)
    threading.Timer(0.05, late.raw.done.set).start()
    assert late.wait(2) is True  # closed driver: the wait polls, still bounded
