"""Host memory stays flat from step to step: nothing a step made outlives it but weights, gradients,
optimizer state and the undo's reused before-image buffers."""

import gc

import pytest
import torch
from torch import nn

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

WIDTH = 48


def _weight_sized_extras(net, opt):
    """Live tensors shaped like a weight matrix that are none of the weights, their .grad or optimizer state."""
    gc.collect()
    known = set()
    for p in net.parameters():
        known.add(p.untyped_storage().data_ptr())
        if p.grad is not None:
            known.add(p.grad.untyped_storage().data_ptr())
        for v in opt.state.get(p, {}).values():
            if torch.is_tensor(v):
                known.add(v.untyped_storage().data_ptr())
    extras = {}
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, nn.Parameter) and o.shape == (WIDTH, WIDTH):
            ptr = o.untyped_storage().data_ptr()
            if ptr not in known:
                extras[ptr] = o.untyped_storage().nbytes()
    return extras


@pytest.mark.timeout(60)
@pytest.mark.parametrize("undo", [False, True])
def test_steps_keep_no_copy_of_the_weights_beyond_weights_grads_state_and_undo_buffers(undo):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    ov = runtime.overlap_optimizer(opt, undo=undo)
    x = torch.randn(4, WIDTH)
    seen = []
    try:
        for _ in range(4):
            def closure():
                opt.zero_grad()
                loss = net(x).pow(2).mean()
                with ov.last_backward():
                    loss.backward()
                return loss

            opt.step(closure)
            runtime.join()
            # A stage's release (which drops its worker-side gradients) runs on its lane after the
            # gradients are home, and may still be queued when the join returns.
            runtime.pool.drain()
            extras = _weight_sized_extras(net, opt)
            seen.append((len(extras), sum(extras.values())))
    finally:
        runtime.detach()
    assert seen == [(0, 0)] * 4
    # undo: the before-images of every parameter's data, exp_avg and exp_avg_sq, in flat reused buffers
    params = sum(p.numel() for p in net.parameters())
    assert ov.before_images.nbytes() >= (3 * params * 4 if undo else 0)
    assert ov.before_images.nbytes() <= (3 * params * 4 + 4 * 8 * 64 if undo else 0)
