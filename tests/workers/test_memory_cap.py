"""A per-worker memory cap on the CPU backend: the task that does not fit fails with WorkerOutOfMemoryError,
the step leaves weights and optimizer state as they were, and the next step that fits trains."""

import gc

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from lightning_roundpipe import OptionError, RoundPipeRuntime, RuntimeOptions, WorkerOutOfMemoryError
from lightning_roundpipe.schedule.plan import PlanError
from lightning_roundpipe.workers import CpuWorkerPool

CAP = 600_000  # bytes per worker: 32 rows fit, 8192 do not


def _net():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)], nn.Linear(64, 4))


def _state(net, opt):
    return ([p.detach().clone() for p in net.parameters()],
            [{k: v.clone() for k, v in opt.state[p].items()} for p in net.parameters()])


def test_a_task_over_the_cap_fails_naming_it_and_the_step_changes_nothing():
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, cpu_memory_cap_bytes=CAP,
                                                               step_metrics=False))
    ov = rt.overlap_optimizer(opt)
    gen = torch.Generator().manual_seed(0)

    def step(rows):
        def closure():
            opt.zero_grad()
            loss = net(torch.randn(rows, 64, generator=gen)).square().mean()
            loss.backward()
            return loss
        opt.step(closure)
        rt.join()

    try:
        for _ in range(2):
            step(32)
        before = _state(net, opt)
        with pytest.raises(WorkerOutOfMemoryError) as info:
            step(8192)
        err = info.value
        assert isinstance(err, MemoryError)
        text = str(err)
        assert f"worker {err.worker} is out of memory in the {err.kind} task of stage {err.stage}" in text
        assert err.stage[0] in "FB" and err.kind in ("weights", "forward", "backward", "act_in", "grad_in")
        if err.kind != "weights":  # a weights upload is per stage, every other task per microbatch
            assert err.microbatch in (0, 1) and f"microbatch {err.microbatch}" in text
        assert err.cap_bytes == CAP and err.held_bytes + err.requested_bytes > CAP
        assert f"asked for {err.requested_bytes} bytes" in text and f"holding {err.held_bytes} bytes" in text
        assert "more microbatches" in text and "recompute" in text and "memory_budget_bytes" in text
        after = _state(net, opt)
        assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
        assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(before[1], after[1]))
        gc.collect()
        assert rt.pool.held_device_bytes() == [0, 0]  # the failed step's device tensors are all gone
        step(32)  # a step that fits trains again
        assert not any(torch.equal(a, b) for a, b in zip(before[0], [p.detach() for p in net.parameters()]))
        # A refused allocation is never held: no worker's peak ever passed the cap.
        assert 0 < max(rt.pool.peak_device_bytes()) <= CAP
    finally:
        rt.detach()


def test_weights_over_the_cap_fail_in_their_upload():
    pool = CpuWorkerPool(1, memory_cap_bytes=100).start()
    try:
        from lightning_roundpipe.workers import TaskLabel

        done = pool.workers[0].submit("upload", lambda: pool.workers[0].track_weights(150), [],
                                      TaskLabel("weights", "F0", -1, 0, "upload"))
        with pytest.raises(WorkerOutOfMemoryError, match="worker 0 is out of memory in the weights task of stage F0: "
                                                         "it asked for 150 bytes"):
            done.wait(5.0)
        assert pool.workers[0].memory.weight_bytes == 150  # counted: the stage's release takes it off
    finally:
        pool.shutdown()


def test_the_cap_option_is_checked_and_in_the_hydra_config():
    with pytest.raises(OptionError, match=r"cpu_memory_cap_bytes=0\): must be a whole number >= 1 or None"):
        RuntimeOptions(cpu_memory_cap_bytes=0).validate()
    with pytest.raises(OptionError, match="cpu_memory_cap_bytes"):
        RuntimeOptions(cpu_memory_cap_bytes=1.5).validate()
    assert RuntimeOptions(cpu_memory_cap_bytes=2**30).validate().cpu_memory_cap_bytes == 2**30
    conf = OmegaConf.load("conf/strategy/roundpipe.yaml")
    assert conf.cpu_memory_cap_bytes is None


def _small_net():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)], nn.Linear(8, 1))


def _peak(cap, rows=8):
    net = _small_net()
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, cpu_memory_cap_bytes=cap))
    try:
        net(torch.randn(rows, 8, generator=torch.Generator().manual_seed(0))).square().mean().backward()
        return max(rt.pool.peak_device_bytes())
    finally:
        rt.detach()


def test_the_planner_accepts_a_cap_just_above_the_measured_peak():
    # Issue 20 item 16. Before: the first plan priced 512-token microbatches (16 KiB of activations
    # per layer for 128 B real ones) and refused every cap up to several times the measured peak.
    peak = _peak(10**9)
    for factor in (1.0, 1.5, 2.0):
        assert _peak(int(peak * factor)) <= peak * factor


def test_activations_over_the_cap_are_refused_at_the_first_batch_naming_the_cap_option():
    net = _small_net()
    before = [p.detach().clone() for p in net.parameters()]
    rt = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, cpu_memory_cap_bytes=20_000))
    try:
        with pytest.raises(PlanError) as err:  # 2048 rows per microbatch: 64 KiB of activations per layer
            net(torch.randn(4096, 8)).square().mean().backward()
        text = str(err.value)
        assert text.startswith("layer 0 needs ") and "one microbatch's activations 64.00 KiB" in text
        assert "Raise cpu_memory_cap_bytes, use fewer tokens per microbatch" in text and "memory_budget_bytes" not in text
        assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
        assert all(p.grad is None for p in net.parameters())  # nothing ran
        assert net(torch.randn(8, 8)).shape == (8, 1)  # a batch that fits runs
    finally:
        rt.detach()


def test_weights_over_the_budget_are_refused_at_set_up_naming_the_budget_option():
    with pytest.raises(PlanError, match=r"Raise partition\.memory_budget_bytes, use fewer tokens"):
        RoundPipeRuntime.attach(_small_net(), "cpu", 2, RuntimeOptions(partition={"memory_budget_bytes": 600}))
