"""A backward inside ``returning_early()`` returns before its weight-gradient tail; the next entry finishes it.

Exact: the gradients and weights equal the waiting path's bit for bit. Overlapped: the next call's
first forward compute starts before the previous call's last backward compute ends. A failure of
the owed tail raises the waiting path's error at the next engine entry, and ``.grad`` stays as
it was before that call's backward. Where the rule says wait (an input wants a gradient, a
parameter hook), the backward waits.
"""

import copy
import threading
import time

import pytest
import torch
from torch import nn

from lightning_roundpipe import CpuWorkerPool, EngineOptions, PipelineEngine, WorkerError
from lightning_roundpipe.planning.cuts import simple_plan
from lightning_roundpipe.workers.pool import Worker

from _models import FailingBackward, InjectedBackwardFailure, LossHead, mlp


def make_engine(layers, workers=2, microbatches=2, fused=False, delay=0.0, jitter=0.0, timeout=30):
    pool = CpuWorkerPool(workers, timeout_s=timeout, compute_delay_s=delay, jitter_s=jitter)
    plan = simple_plan(len(layers), workers, fused_last=fused)
    return PipelineEngine(layers, pool, plan, EngineOptions(microbatches=microbatches))


def batches(n, width=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, width, generator=g) for _ in range(n)]


def accumulate(eng, xs, early, fused):
    """One step's calls: every backward but the last inside returning_early when ``early``."""
    for i, x in enumerate(xs):
        loss = eng(x, loss_scale=0.25) if fused else eng(x).pow(2).mean()
        last = i == len(xs) - 1
        if early and not last:
            with eng.returning_early():
                loss.backward()
            assert eng.owed_tail is not None  # it did return early
        else:
            loss.backward()
            assert eng.owed_tail is None


def train(layers, calls, early, fused, steps=2, dropout_seed=0, **engine_kwargs):
    eng = make_engine(layers, fused=fused, **engine_kwargs)
    params = [p for layer in layers for p in layer.parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    grads = []
    try:
        torch.manual_seed(dropout_seed)
        for step in range(steps):
            opt.zero_grad()
            accumulate(eng, batches(calls, seed=step), early, fused)
            grads.append([p.grad.clone() for p in params])
            opt.step()
    finally:
        eng.close()
    return grads, [p.detach().clone() for p in params]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("calls,fused,dropout", [(2, False, 0.0), (3, False, 0.1), (3, True, 0.0)])
def test_returning_early_is_bit_identical_to_waiting(calls, fused, dropout):
    base = mlp(depth=4, width=8, dropout=dropout) + ([LossHead(8)] if fused else [nn.Linear(8, 8)])
    waited_grads, waited = train(copy.deepcopy(base), calls, early=False, fused=fused, jitter=0.002)
    early_grads, early = train(copy.deepcopy(base), calls, early=True, fused=fused, jitter=0.002)
    for a, b in zip(waited_grads, early_grads):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(waited, early))


def traced_computes(monkeypatch, eng):
    """(call, kind, start, end) of every compute task, the call being the engine's call count at submission."""
    rows, lock = [], threading.Lock()
    submit = Worker.submit

    def timed_submit(worker, queue, fn, deps, label, priority=0, nbytes=0, always=False):
        if queue != "compute":
            return submit(worker, queue, fn, deps, label, priority, nbytes, always)
        call = eng.step_count

        def timed(*args, _fn=fn, **kwargs):
            start = time.monotonic()
            try:
                return _fn(*args, **kwargs)
            finally:
                with lock:
                    rows.append((call, label.kind, start, time.monotonic()))

        return submit(worker, queue, timed, deps, label, priority, nbytes, always)

    monkeypatch.setattr(Worker, "submit", timed_submit)
    return rows


@pytest.mark.timeout(60)
@pytest.mark.parametrize("early", [True, False])
def test_the_next_forward_starts_before_the_previous_backward_ends_only_when_returning_early(early, monkeypatch):
    layers = mlp(depth=5, width=8) + [nn.Linear(8, 8)]
    eng = make_engine(layers, workers=3, microbatches=2, delay=0.03)
    rows = traced_computes(monkeypatch, eng)
    try:
        accumulate(eng, batches(2), early, fused=False)
    finally:
        eng.close()
    first_forward = min(start for call, kind, start, _ in rows if call == 2 and kind == "forward")
    last_backward = max(end for call, kind, _, end in rows if call == 1 and kind == "backward")
    assert (first_forward < last_backward) is early, (first_forward, last_backward)




class Boom(nn.Module):
    def __init__(self, state):
        super().__init__()
        self.state = state
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return FailingBackward.apply(self.lin(x), self.state)


def failed_first_backward(early):
    """Call 1's backward fails in its first layer; returns the error and ``.grad`` after it, and
    checks that the engine then runs a clean call exactly."""
    state = {"backwards": 0, "fail_at": 1}  # the first backward of the Boom layer (call 1, microbatch 0)
    torch.manual_seed(0)
    layers = [Boom(state)] + mlp(depth=3, width=8) + [nn.Linear(8, 8)]
    eng = make_engine(layers, workers=2, microbatches=2)
    params = [p for layer in layers for p in layer.parameters()]
    try:
        x1, x2, x3 = batches(3)
        loss = eng(x1).pow(2).mean()
        if early:
            with eng.returning_early():
                loss.backward()  # returns: the failure is in the owed tail
            assert eng.owed_tail is not None
            with pytest.raises(WorkerError) as info:
                eng(x2)  # the next entry finishes the tail
        else:
            with pytest.raises(WorkerError) as info:
                loss.backward()
        assert isinstance(info.value.original, InjectedBackwardFailure)
        assert eng.owed_tail is None
        after = [None if p.grad is None else p.grad.clone() for p in params]
        # The engine runs on: a clean call and backward give the plain module's gradients.
        for p in params:
            p.grad = None
        eng(x3).pow(2).mean().backward()
        reference = copy.deepcopy(layers)
        for q in (q for layer in reference for q in layer.parameters()):
            q.grad = None
        out = x3
        for layer in reference:
            out = layer(out)
        out.pow(2).mean().backward()
        for p, q in zip(params, (q for layer in reference for q in layer.parameters())):
            torch.testing.assert_close(p.grad, q.grad)
    finally:
        eng.close()
    return info.value, after


@pytest.mark.timeout(60)
def test_a_failed_owed_tail_raises_the_waiting_error_at_the_next_entry_and_leaves_grad_as_waiting_does():
    waited_error, waited_grads = failed_first_backward(early=False)
    early_error, early_grads = failed_first_backward(early=True)
    assert "injected failure in backward number 1" in str(early_error)
    assert str(early_error) == str(waited_error)
    # The failed stage's layer gets nothing; what reached .grad before it is the same on both paths.
    assert early_grads[0] is None and early_grads[1] is None
    assert [g is None for g in early_grads] == [g is None for g in waited_grads]
    assert all(a is None or torch.equal(a, b) for a, b in zip(early_grads, waited_grads))


@pytest.mark.timeout(30)
def test_a_non_training_forward_and_close_finish_or_drop_the_owed_tail():
    layers = mlp(depth=3, width=8) + [nn.Linear(8, 8)]
    eng = make_engine(layers)
    params = [p for layer in layers for p in layer.parameters()]
    try:
        with eng.returning_early():
            eng(batches(1)[0]).pow(2).mean().backward()
        assert eng.owed_tail is not None and all(p.grad is None for p in params)
        with torch.no_grad():
            eng(batches(1)[0])
        assert eng.owed_tail is None and all(p.grad is not None for p in params)
    finally:
        eng.close()


@pytest.mark.timeout(30)
def test_an_input_wanting_a_gradient_or_a_parameter_hook_makes_backward_wait():
    layers = mlp(depth=3, width=8) + [nn.Linear(8, 8)]
    eng = make_engine(layers)
    try:
        x = batches(1)[0].requires_grad_(True)
        with eng.returning_early():
            eng(x).pow(2).mean().backward()
        assert eng.owed_tail is None and x.grad is not None
        seen = []
        layers[1][0].weight.register_hook(lambda g: seen.append(g.clone()))
        with eng.returning_early():
            eng(batches(1)[0]).pow(2).mean().backward()
        assert eng.owed_tail is None and len(seen) == 1
    finally:
        eng.close()


@pytest.mark.timeout(60)
def test_overlapped_calls_keep_each_worker_within_two_stages_of_weights():
    """The next call's uploads wait on the worker's history, which spans calls: a worker never holds
    more than prefetch_depth + 1 = 2 stages' weights, while the previous backward still drains."""
    layers = mlp(depth=5, width=16) + [nn.Linear(16, 16)]  # 6 equal layers of 272 fp32 parameters
    eng = make_engine(layers, workers=3, microbatches=2, jitter=0.003)
    stage_bytes = max(sum(p.numel() * p.element_size() for layer in layers[s.start:s.end] for p in layer.parameters())
                      for s in eng.plan.forward_stages() + eng.plan.backward_stages())
    try:
        for step in range(2):
            accumulate(eng, [x.repeat(1, 2) for x in batches(4, seed=step)], early=True, fused=False)
        peaks = eng.pool.peak_weight_bytes()
        assert max(peaks) > stage_bytes  # prefetching really held two stages somewhere
        assert all(peak <= 2 * stage_bytes for peak in peaks), (peaks, stage_bytes)
        eng.pool.drain()  # a stage's free runs on its lane after the backward has returned
        assert eng.pool.held_device_bytes() == [0, 0, 0]
    finally:
        eng.close()
