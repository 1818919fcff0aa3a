"""The emulated-GPU backend (roundpipe_lab/fake_cuda/emulated.py): the fake-stream protocol whose stream work lasts a
device time. Its results are bit for bit those of the CPU backend at every worker count, and a
two-stage step takes the device time one can work out by hand."""

import time

import pytest
import torch
from torch import nn

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.options import PartitionConfig
from lightning_roundpipe.workers import make_pool
from lightning_roundpipe.cost.task_seconds import ProfileDeviceTimes
from roundpipe_lab.fake_cuda.emulated import EmulatedWorkerPool

from tests._models import mlp


def _train(backend: str, workers: int, optimizer: str, device_time=None, steps: int = 2):
    model = nn.Sequential(*mlp(depth=4, width=8, seed=3))
    rt = RoundPipeRuntime.attach(model, backend, workers, RuntimeOptions(microbatches=2, step_metrics=False))
    if device_time is not None:
        rt.pool.emulate(device_time)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if optimizer == "sgd" else torch.optim.AdamW(params, lr=1e-2)
    opt = rt.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    try:
        for _ in range(steps):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        rt.join()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        rt.detach()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_emulated_weights_are_bit_identical_to_the_cpu_backend_at_1_to_8_workers(optimizer):
    # Device times that differ per task kind reorder when work finishes; the results must not move.
    def device_time(label, nbytes):
        return 2e-4 if label.kind in ("forward", "backward") else 5e-5
    for workers in range(1, 9):
        cpu = _train("cpu", workers, optimizer)
        emulated = _train("emulated", workers, optimizer, device_time)
        for a, b in zip(cpu, emulated):
            assert torch.equal(a, b), f"{workers} workers: weights differ by {(a - b).abs().max().item()}"


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


@pytest.mark.timeout(30)
def test_emulated_device_time_is_honoured_on_a_hand_computed_two_stage_step():
    # Two layers, two forward stages (F0 on worker 0, F1 on worker 1), then B1 on worker 0 and B0 on
    # worker 1 (round robin), two microbatches. Every compute lasts C, transfers take no time:
    #   F0 mb0 [0, C]  mb1 [C, 2C]    worker 0
    #   F1 mb0 [C, 2C] mb1 [2C, 3C]   worker 1; the host then has both outputs and computes the loss
    #   B1 mb0 [3C, 4C] mb1 [4C, 5C]  worker 0
    #   B0 mb0 [4C, 5C] mb1 [5C, 6C]  worker 1                   => the step lasts 6C (serial: 8C)
    C = 0.15
    model = nn.Sequential(_Block(), _Block())
    options = RuntimeOptions(microbatches=2, step_metrics=False,
                             partition=PartitionConfig(policy="manual", manual_forward=[[0, 1], [1, 2]]))
    rt = RoundPipeRuntime.attach(model, "emulated", 2, options)
    assert isinstance(rt.pool, EmulatedWorkerPool)
    assert rt.planner.plan.to_text() == "F 0:1 1:2 | B 0:1 1:2"
    rt.pool.emulate(lambda label, nbytes: C if label.queue == "compute" else 0.0)
    x = torch.randn(4, 4)
    try:
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        rt.pool.synchronize()
        wall = time.perf_counter() - t0
    finally:
        rt.detach()
    # Each worker's device ran its four computes: 4C of device time charged per worker.
    assert rt.pool.device_seconds == pytest.approx([4 * C, 4 * C])
    # Never faster than the device time; well below the serial 8C (generous: a loaded host).
    assert 6 * C <= wall < 7.5 * C, f"the step took {wall:.3f}s, the device time is {6 * C:.3f}s"


@pytest.mark.timeout(10)
def test_profile_device_times_price_tasks_as_the_simulator_does():
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.profile import CostProfile, LayerCost
    from lightning_roundpipe.schedule.plan import Plan
    from lightning_roundpipe.workers.completions import TaskLabel

    hw = load_hardware("rtx4090")
    layer = dict(forward_s=0.01, recompute_s=0.01, backward_s=0.02, weight_bytes=10**9, grad_bytes=10**9,
                 act_bytes_per_token=1000)
    costs = CostProfile(layers=[LayerCost(**layer) for _ in range(2)], tokens_per_microbatch=500)
    times = ProfileDeviceTimes(Plan(2, ((0, 1), (1, 2)), ((0, 1), (1, 2))), costs, hw, [100, 100])
    link = hw.host_device_bytes_per_s
    assert times(TaskLabel("forward", "F1"), 0) == pytest.approx(0.01)
    assert times(TaskLabel("weights", "F0"), 50) == pytest.approx(hw.latency_s + 0.5e9 / link)  # half the stage
    assert times(TaskLabel("wgrad", "B0"), 0) == pytest.approx(hw.latency_s + 1e9 / link)
    assert times(TaskLabel("act_out", "F0"), 0) == pytest.approx(hw.latency_s + 5e5 / link)  # 500 tokens x 1000 B
    assert times(TaskLabel("backward", "B1"), 0) == pytest.approx(0.03)  # recompute + backward
    with pytest.raises(ValueError, match="must describe the same layers"):
        ProfileDeviceTimes(Plan(2, ((0, 1), (1, 2)), ((0, 1), (1, 2))), costs, hw, [100])


@pytest.mark.timeout(10)
def test_a_non_positive_time_scale_is_refused():
    with pytest.raises(ValueError, match="time_scale must be positive, got 0"):
        make_pool("emulated", 1, time_scale=0)
    pool = make_pool("emulated", 1)
    try:
        with pytest.raises(ValueError, match="time_scale must be positive, got -1"):
            pool.emulate(None, time_scale=-1)
        assert pool.time_scale == 1.0 and pool.device_time is None  # unchanged after the refusal
    finally:
        pool.shutdown()


@pytest.mark.timeout(20)
def test_without_a_duplex_link_a_workers_upload_and_download_take_turns():
    from lightning_roundpipe.workers import TaskLabel

    pool = make_pool("emulated", 1, duplex=False).start()
    try:
        pool.emulate(lambda label, nbytes: 0.1)
        worker = pool.workers[0]
        t0 = time.perf_counter()
        up = worker.submit("upload", lambda: 1, [], TaskLabel("act_in", "F0", 0, 0, "upload"))
        down = worker.submit("download", lambda: 2, [], TaskLabel("act_out", "F0", 0, 0, "download"))
        assert (up.wait(10), down.wait(10)) == (1, 2)
        assert time.perf_counter() - t0 >= 0.2  # one link: 0.1 s each, one after the other
        assert pool.device_seconds == pytest.approx([0.2])
    finally:
        pool.shutdown()
