"""The CPU backend's measured device memory: what the tally counts, and the pool's figures after a step."""

import gc

import torch
from torch import nn

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.workers import TaskLabel
from lightning_roundpipe.workers.device_memory import AllocationTally
from lightning_roundpipe.workers.pool import DeviceMemory


def test_tally_counts_new_storages_once_and_frees_them_when_they_die():
    memory = DeviceMemory(0)
    x = torch.ones(16, 8)  # made outside the tally: not the worker's
    with AllocationTally(memory):
        y = x * 2  # new: 512 bytes
        view = y.t()  # a view shares y's storage
        y.add_(1)  # in place: no new storage
        z = torch.empty(100, dtype=torch.float64)  # 800 bytes
        assert memory.tensor_bytes == 512 + 800
        del z
        gc.collect()
        assert memory.tensor_bytes == 512
        del y, view
        gc.collect()
    assert memory.tensor_bytes == 0
    assert memory.peak_bytes == 512 + 800


def test_tally_sees_the_graph_autograd_keeps_and_the_gradients():
    memory = DeviceMemory(0)
    w = torch.ones(4, 4, requires_grad=True)
    x = torch.ones(8, 4)
    with AllocationTally(memory):
        h = (x @ w).tanh()  # mm output 128 B (freed: tanh keeps its own output), tanh output 128 B kept
        assert memory.tensor_bytes == 128
        h.sum().backward()  # backward runs on this thread: w.grad (64 B) is counted
        del h
        gc.collect()
    assert memory.tensor_bytes == 64 and w.grad is not None
    w.grad = None
    gc.collect()
    assert memory.tensor_bytes == 0


def test_weights_are_counted_by_the_ledger_and_the_peak_names_its_task():
    memory = DeviceMemory(3)
    label = TaskLabel("weights", "F1", -1, 3, "upload")
    memory.track_weights(1000, label)
    memory.track_weights(-1000)
    assert (memory.weight_bytes, memory.peak_bytes, memory.peak_weight_bytes, memory.peak_task) == (0, 1000, 1000, label)
    memory.reset_peak()
    assert (memory.peak_bytes, memory.peak_task) == (0, None)


def _step(rt, net, rows):
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
    net(x).square().mean().backward()
    rt.pool.drain()  # backward returns once the gradients are home; the stages' releases may still run


def test_pool_reports_per_worker_peaks_and_holds_nothing_after_a_step():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, partition="uniform",
                                                               overlap_optimizer=False))
    try:
        rt.pool.start_measuring_memory()
        _step(rt, net, 64)
        small = rt.pool.peak_device_bytes()
        weights = rt.pool.peak_weight_bytes()
        # Every device tensor of the step is gone with it: the completions drop their values once read.
        assert rt.pool.held_device_bytes() == [0, 0]
        assert all(p > w > 0 for p, w in zip(small, weights))
        rt.pool.reset_peak_device_bytes()
        _step(rt, net, 256)  # 4x the rows: the activations grow, the weights do not
        big = rt.pool.peak_device_bytes()
        assert all(b - w > 3 * (s - w) for b, s, w in zip(big, small, weights))
        assert rt.pool.held_device_bytes() == [0, 0]
        assert rt.last_metrics["peak_device_bytes"] == big
    finally:
        rt.detach()


def test_step_metrics_carry_the_peaks():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, cpu_memory_cap_bytes=10**9,
                                                               overlap_optimizer=False))
    try:
        net(torch.randn(8, 16)).sum().backward()
        assert rt.last_metrics["peak_device_bytes"] == rt.pool.peak_device_bytes()
        assert min(rt.pool.peak_device_bytes()) > 0
    finally:
        rt.detach()
