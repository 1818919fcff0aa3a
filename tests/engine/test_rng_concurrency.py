"""The CPU generator gate: layers known not to draw run together; a draw they make is never used."""

import threading
import time

import pytest
import torch
from torch import nn

from _exact_models import GRAD_TOL, LAYERED, seeded_reference
from lightning_roundpipe import PipelineError, RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.engine.rng import CpuGeneratorGate, UnseededDraw
from lightning_roundpipe.options import PartitionConfig


def test_gate_lets_shared_holders_in_together_and_an_exclusive_one_alone():
    gate = CpuGeneratorGate()
    both_inside = threading.Barrier(2, timeout=10)  # passes only if two shared holders are inside at once
    errors = []

    def shared():
        try:
            token = gate.enter_shared((0, 0, "x"))
            both_inside.wait()
            assert gate.exit_shared(token) == []
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=shared) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

    entered = threading.Event()

    def late_reader():
        gate.exit_shared(gate.enter_shared((1, 0, "y")))
        entered.set()

    with gate.exclusive():
        reader = threading.Thread(target=late_reader)
        reader.start()
        assert not entered.wait(0.3)  # kept out while the exclusive holder is inside
    assert entered.wait(10)
    reader.join()


def test_gate_sees_a_draw_inside_a_shared_period_and_puts_the_generator_back():
    gate = CpuGeneratorGate()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    a = gate.enter_shared((0, 0, "A"))
    b = gate.enter_shared((1, 0, "B"))
    torch.rand(3)
    assert gate.exit_shared(a) == [(0, 0, "A"), (1, 0, "B")]  # either may have drawn: both are refused
    assert torch.equal(torch.get_rng_state(), before)
    assert gate.exit_shared(b) == [(0, 0, "A"), (1, 0, "B")]
    c = gate.enter_shared((0, 1, "A"))
    assert gate.exit_shared(c) == []  # a clean period after it


class Sleeper(nn.Module):
    """A linear layer that records when it runs, and stays inside long enough to meet another worker."""

    def __init__(self, width, name, log, dropout=0.0):
        super().__init__()
        self.lin, self.drop, self.name, self.log = nn.Linear(width, width), nn.Dropout(dropout), name, log

    def forward(self, x):
        start = time.perf_counter()
        time.sleep(0.02)
        y = self.drop(torch.tanh(self.lin(x)))
        self.log.append((self.name, start, time.perf_counter()))
        return y


def _overlaps(log, names):
    spans = [(n, a, b) for n, a, b in log if n in names]
    return [(n1, n2) for i, (n1, a1, b1) in enumerate(spans) for n2, a2, b2 in spans[i + 1:]
            if n1 != n2 and min(b1, b2) > max(a1, a2)]


@pytest.mark.timeout(60)
def test_layers_known_not_to_draw_run_at_once_on_the_cpu_backend_and_random_ones_alone():
    torch.manual_seed(0)
    log = []
    net = nn.Sequential(Sleeper(8, "quiet0", log), Sleeper(8, "quiet1", log), Sleeper(8, "drop2", log, 0.1),
                        Sleeper(8, "drop3", log, 0.1))
    x = torch.randn(8, 8)
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=4, step_metrics=False, **LAYERED))
    try:
        for _ in range(3):
            log.clear()
            net(x).sum().backward()
    finally:
        runtime.detach()
    # The last step: quiet layers on the two workers were inside at the same time ...
    assert _overlaps(log, {"quiet0", "quiet1"})
    # ... and a layer with dropout (seeded) never shared the generator with any other layer.
    for n1, n2 in _overlaps(log, {"quiet0", "quiet1", "drop2", "drop3"}):
        assert n1.startswith("quiet") and n2.startswith("quiet"), (n1, n2)


class LateJitter(nn.Module):
    """Draws nothing on its first call, then multiplicative noise on every call (or another thread draws)."""

    def __init__(self, width, by_thread=False):
        super().__init__()
        self.lin, self.calls, self.by_thread = nn.Linear(width, width), 0, by_thread

    def forward(self, x):
        self.calls += 1
        x = torch.tanh(self.lin(x))
        if self.calls < 2:
            return x
        if self.by_thread:  # another thread draws from the default generator while this layer runs
            t = threading.Thread(target=torch.rand, args=(5,))
            t.start()
            t.join()
            return x
        return x * torch.empty_like(x).uniform_(0.9, 1.1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("by_thread", [False, True])
def test_a_layer_that_starts_drawing_later_is_refused_then_runs_seeded_and_exact(by_thread):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()), LateJitter(8, by_thread), nn.Linear(8, 1)]
    net = nn.Sequential(*layers)
    x = torch.randn(4, 8)
    # split_check=False: LateJitter's call counter is per-call state by design (it draws from its second call on,
    # which here is microbatch 1), so the split-invariance check (on by default since the split-check merge)
    # rightly refuses it before any step; this test is about the RNG gate, and seeded_reference replays the
    # same per-microbatch calls
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False,
                                                                    split_check=False, **LAYERED))
    try:
        torch.manual_seed(21)
        before = torch.get_rng_state()
        with pytest.raises(PipelineError) as info:
            net(x).sum().backward()
        assert isinstance(info.value.original, UnseededDraw)
        message = str(info.value)
        # its second call (the first ran seeded), in a run of layers checked as one (all known quiet by then)
        assert "layers 1-2 (LateJitter, Linear), microbatch 1 ran as layers known not to draw" in message
        assert "another thread drew from torch's default CPU generator" in message
        assert "now run seeded" in message
        assert torch.equal(torch.get_rng_state(), before)  # the refused call drew nothing from the caller's stream
        assert all(p.grad is None for p in net.parameters())
        net(x).sum().backward()  # now seeded: exact
        base = runtime.engine.last_run.rng.base_seed
        got = {n: p.grad.clone() for n, p in net.named_parameters()}
    finally:
        runtime.detach()
    if by_thread:
        return  # the stray draw was another thread's: the run itself draws nothing (checked above)
    net.zero_grad(set_to_none=True)
    seeded_reference(layers, x, base, 2).sum().backward()
    for n, p in net.named_parameters():
        assert ((got[n] - p.grad).norm() / p.grad.norm()).item() <= GRAD_TOL, n


class MoreNoiseWithGrad(nn.Module):
    """Draws once in a no-grad forward and twice with grad: its recompute draws other numbers."""

    def forward(self, x):
        noise = torch.rand_like(x)
        if torch.is_grad_enabled():
            noise = noise * torch.rand_like(x)
        return x * (0.9 + 0.2 * noise)


@pytest.mark.timeout(60)
def test_a_recompute_drawing_other_numbers_than_its_forward_is_refused():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), MoreNoiseWithGrad(), nn.Linear(8, 1))
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False, **LAYERED))
    try:
        with pytest.raises(PipelineError) as info:
            net(torch.randn(4, 8)).sum().backward()
    finally:
        runtime.detach()
    assert isinstance(info.value.original, UnseededDraw)
    # every microbatch's recompute fails; the weight gradients wait for each, and report the first
    assert "layer 1 (MoreNoiseWithGrad), microbatch 0 drew different random numbers in recompute" in str(info.value)


@pytest.mark.timeout(60)
def test_quiet_layers_running_shared_leave_the_caller_stream_as_a_plain_run():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    x = torch.randn(4, 8)
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=4, step_metrics=False, **LAYERED))
    try:
        for _ in range(3):  # the first step runs each layer seeded once; the later ones shared
            torch.manual_seed(9)
            net(x).sum().backward()
            assert torch.equal(torch.get_rng_state(), torch.manual_seed(9).get_state())
            assert not runtime.engine.last_run.rng.drew
    finally:
        runtime.detach()


def _count_shared_periods(monkeypatch):
    """Spy on the CPU gate: what each shared period entered for (a layer index or a range of layers)."""
    from lightning_roundpipe.engine import rng

    entered = []
    enter = rng.CPU_GENERATOR.enter_shared

    def spy(what, *args, **kwargs):
        entered.append(what[0])
        return enter(what, *args, **kwargs)

    monkeypatch.setattr(rng.CPU_GENERATOR, "enter_shared", spy)
    return entered


@pytest.mark.timeout(60)
def test_a_run_of_layers_known_not_to_draw_is_checked_as_one_shared_period(monkeypatch):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])
    x = torch.randn(8, 8)
    split = [[0, 3], [3, 6]]
    options = RuntimeOptions(microbatches=4, step_metrics=False, recompute="never",
                             partition=PartitionConfig(policy="manual", manual_forward=split, manual_backward=split))
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, options)
    try:
        net(x).sum().backward()  # the first call learns that no layer draws (each runs seeded, alone)
        entered = _count_shared_periods(monkeypatch)
        torch.manual_seed(5)
        before = torch.get_rng_state()
        net.zero_grad(set_to_none=True)
        net(x).sum().backward()
        got = {n: p.grad.clone() for n, p in net.named_parameters()}
    finally:
        runtime.detach()
    # two forward stages of three layers, four microbatches: 8 periods, each over a stage's range, not 24
    assert sorted(map(str, entered)) == sorted(["range(0, 3)", "range(3, 6)"] * 4)
    assert torch.equal(torch.get_rng_state(), before)  # nothing drawn from the caller's stream
    net.zero_grad(set_to_none=True)
    net(x).sum().backward()  # plain torch on the detached model
    for n, p in net.named_parameters():
        assert ((got[n] - p.grad).norm() / p.grad.norm()).item() <= GRAD_TOL, n


@pytest.mark.timeout(60)
def test_a_call_with_a_drawing_layer_keeps_one_shared_period_per_quiet_layer(monkeypatch):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 1))
    split = [[0, 3], [3, 5]]
    options = RuntimeOptions(microbatches=2, step_metrics=False, recompute="never",
                             partition=PartitionConfig(policy="manual", manual_forward=split, manual_backward=split))
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, options)
    try:
        net(torch.randn(4, 8)).sum().backward()
        entered = _count_shared_periods(monkeypatch)
        net(torch.randn(4, 8)).sum().backward()
    finally:
        runtime.detach()
    # the dropout layer may draw: a run beside it would keep it waiting a whole stage, so each quiet
    # layer has its own period (a seeded one has the generator alone, outside any shared period)
    assert sorted(entered) == sorted([0, 1, 2, 4] * 2)
