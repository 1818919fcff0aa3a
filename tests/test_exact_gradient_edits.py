"""User code that edits gradients runs where Lightning runs it: parity with the default strategy.

A callback's ``on_after_backward``, an ``optimizer_step`` override whose closure edits the
gradients, ``param.register_hook`` and ``register_post_accumulate_grad_hook`` on host
parameters; SGD with momentum (no clipping) and AdamW, several backward stages so that layers
could step during backward."""

import lightning as L
import pytest
import torch

from _exact_models import LAYERED, WEIGHT_TOL, SeqModule, parity

STRATEGY = {"microbatches": 2, **LAYERED}


class ZeroAndScaleGrads(L.Callback):
    def on_after_backward(self, trainer, pl_module):
        for p in pl_module.net[1].parameters():
            p.grad.zero_()
        pl_module.net[4].weight.grad.mul_(0.25)


class ClosureEditsGrads(SeqModule):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        def closure():
            loss = optimizer_closure()
            self.net[0][0].weight.grad.mul_(-0.5)
            self.net[3][0].bias.grad.zero_()
            return loss

        optimizer.step(closure=closure)


class TensorHooks(SeqModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # nonlinear in the gradient: exact only if it sees the whole gradient of the backward once
        self.net[2][0].weight.register_hook(lambda g: g.clamp(-0.02, 0.02))
        self.net[0][0].bias.register_hook(lambda g: g * 3.0)


class PostAccumulateHooks(SeqModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = 0

        def halve(p):
            self.seen += 1
            p.grad.mul_(0.5)

        self.net[1][0].weight.register_post_accumulate_grad_hook(halve)


CASES = {
    "callback_on_after_backward": (SeqModule, [ZeroAndScaleGrads]),
    "optimizer_step_closure": (ClosureEditsGrads, []),
    "register_hook": (TensorHooks, []),
    "post_accumulate_grad_hook": (PostAccumulateHooks, []),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradient_edit_matches_default_strategy(case, opt):
    cls, callbacks = CASES[case]
    _, w_err = parity(lambda: cls(opt=opt), max_steps=4, strategy_kwargs=STRATEGY,
                      callbacks=[c() for c in callbacks])
    assert w_err < WEIGHT_TOL, f"{case}/{opt}: weights {w_err:.2e} off the default strategy's"


@pytest.mark.timeout(60)
def test_post_accumulate_hook_fires_once_per_backward():
    """Once per step, on the accumulated gradient (as autograd does for a leaf), also with 2 microbatches."""
    from _models import fit
    from lightning_roundpipe import RoundPipeStrategy

    ref, m = PostAccumulateHooks(), PostAccumulateHooks()
    fit(ref, "auto", max_steps=3, record_grads=False)
    fit(m, RoundPipeStrategy(**STRATEGY), devices=2, max_steps=3, record_grads=False)
    assert (m.seen, ref.seen) == (3, 3)
