"""Before-images taken ahead, while the optimizer lane is idle; a layer the lane has not reached takes its own."""

import threading

import pytest
import torch
from torch import nn

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.workers.completions import TaskLabel

STEPS = 3
LAYERS = 4
HOLD = TaskLabel("test", "hold the lane")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(LAYERS)])


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(STEPS + 1)]


def _state(net, opt):
    weights = [p.detach().clone() for p in net.parameters()]
    moments = [{k: v.clone() for k, v in opt.state[p].items()} for p in net.parameters()]
    return weights, moments


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a[1], b[1]))


def _train(mode):
    """mode: "sync" (no overlap), "idle" (the lane idles through the forward), "busy" (the lane is
    held until backward is over, so every layer step is queued before any image is taken)."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False,
                                                                    testing={"compute_delay_s": 0.003}))
    ov = runtime.overlap_optimizer(opt) if mode != "sync" else None
    try:
        for i, (x, y) in enumerate(_batches()):
            hold = threading.Event()
            if mode == "busy":
                ov.lane.submit(lambda: hold.wait(10), HOLD)

            def closure(fail=i == STEPS):
                opt.zero_grad()
                loss = ((net(x) - y) ** 2).mean()
                if ov is None:
                    loss.backward()
                else:
                    with ov.last_backward():
                        loss.backward()
                hold.set()
                if fail:
                    raise RuntimeError("injected failure after backward")
                return loss

            if i == STEPS:  # the last step fails after its layers stepped early: all put back
                before = _state(net, opt)
                with pytest.raises(RuntimeError, match="injected failure after backward"):
                    opt.step(closure) if ov is not None else closure()
                    runtime.join()
                _same(before, _state(net, opt))
            else:
                if ov is None:
                    closure()
                    opt.step()
                else:
                    opt.step(closure)
                runtime.join()
        return _state(net, opt), (ov.images_taken_at_step if ov is not None else None)
    finally:
        runtime.detach()


@pytest.mark.timeout(60)
def test_images_taken_ahead_or_at_the_step_are_exact_and_put_a_failed_step_back():
    sync, _ = _train("sync")
    idle, idle_at_step = _train("idle")
    busy, busy_at_step = _train("busy")
    _same(sync, idle)  # overlapped with undo equals the synchronous step bit for bit
    _same(sync, busy)
    assert idle_at_step == 0  # every layer's image was ready before its gradient was complete
    # Held lane until backward returned: every layer step is queued when the capture ahead first
    # runs, so it yields before its first image, and each layer step takes its own.
    assert busy_at_step == STEPS * LAYERS
