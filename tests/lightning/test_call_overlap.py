"""``overlap_calls``: with ``accumulate_grad_batches`` the next batch's forward overlaps the previous
backward's drain, exactly (``lightning/call_overlap.py``).

- Parity against Lightning's default strategy (SGD without clipping, AdamW), and bit-identical
  weights to ``overlap_calls=False``.
- The timeline: the next call's first forward compute starts before the previous call's last
  backward compute ends (and does not with ``overlap_calls=False``).
- A failure in call 1's tail fails the fit with the waiting path's error; weights and optimizer
  state stay as they were.
- ``on_after_backward`` overridden: every backward waits, and the hook sees complete gradients.
"""

import lightning as L
import pytest
import torch
from torch import nn

from _models import FailingBackward, InjectedBackwardFailure, SeqModule, fit, make_data, weight_error, weights
from lightning_roundpipe import RoundPipeStrategy, WorkerError


def roundpipe_fit(module, overlap_calls=True, max_steps=3, devices=2, callbacks=(), **trainer_kwargs):
    strategy = RoundPipeStrategy(microbatches=2, overlap_calls=overlap_calls, overlap_optimizer=True)
    trainer, _ = fit(module, strategy, devices=devices, max_steps=max_steps, callbacks=callbacks, **trainer_kwargs)
    return strategy, trainer


@pytest.mark.timeout(90)
@pytest.mark.parametrize("opt,accumulate", [("sgd", 2), ("sgd", 3), ("adamw", 2), ("adamw", 3)])
def test_overlapped_calls_match_the_default_strategy_and_the_waiting_path_bit_for_bit(opt, accumulate):
    init = SeqModule(opt=opt)
    w0 = weights(init)
    ref = SeqModule(opt=opt)
    fit(ref, "auto", max_steps=3, accumulate_grad_batches=accumulate)
    overlapped, waited = SeqModule(opt=opt), SeqModule(opt=opt)
    strategy, _ = roundpipe_fit(overlapped, True, accumulate_grad_batches=accumulate)
    assert strategy.calls_overlap  # the rule let this fit overlap its calls
    strategy, _ = roundpipe_fit(waited, False, accumulate_grad_batches=accumulate)
    assert not strategy.calls_overlap
    assert weight_error(weights(overlapped), weights(ref), w0) < 1e-4
    w_over, w_wait = weights(overlapped), weights(waited)
    assert all(torch.equal(w_over[k], w_wait[k]) for k in w_wait)


class KeepTimeline(L.Callback):
    """Keeps the runtime's trace records (the strategy drops the runtime at teardown)."""

    def __init__(self):
        self.records = []

    def on_train_end(self, trainer, pl_module):
        self.records = trainer.strategy.runtime.trace.records()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("overlap_calls", [True, False])
def test_the_next_batch_forward_starts_before_the_previous_backward_ends(overlap_calls, tmp_path):
    timeline = KeepTimeline()
    strategy = RoundPipeStrategy(microbatches=2, overlap_calls=overlap_calls, trace_steps=4,
                                 testing={"compute_delay_s": 0.04})
    # The second optimizer step's two calls (3 and 4): the first step's host work is not yet warm.
    fit(SeqModule(depth=5), strategy, devices=3, max_steps=2, accumulate_grad_batches=2, callbacks=[timeline],
        default_root_dir=str(tmp_path))
    computes = [r for r in timeline.records if r.queue == "compute"]
    first_forward = min(r.start for r in computes if r.step == 4 and r.kind == "forward")
    last_backward = max(r.end for r in computes if r.step == 3 and r.kind == "backward")
    assert (first_forward < last_backward) is overlap_calls, (first_forward, last_backward)




class FailsFirstBackward(SeqModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state = {"backwards": 0, "fail_at": 1}
        first = self.net[0]
        self.net[0] = nn.Sequential(first, _Apply(self.state))


class _Apply(nn.Module):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def forward(self, x):
        return FailingBackward.apply(x, self.state)


@pytest.mark.timeout(90)
def test_a_failed_tail_fails_the_fit_with_the_waiting_error_and_leaves_weights_and_optimizer_as_before():
    errors = {}
    for overlap_calls in (True, False):
        module = FailsFirstBackward(opt="adamw")
        w0 = weights(module)
        with pytest.raises(WorkerError) as info:
            roundpipe_fit(module, overlap_calls, accumulate_grad_batches=2)
        assert isinstance(info.value.original, InjectedBackwardFailure)
        # Overlapped: raised by the next batch's forward, which finished the failed tail; else by backward.
        raised_in = [entry.name for entry in info.traceback]
        assert ("finish_backward" in raised_in and "training_step" in raised_in) is overlap_calls, raised_in
        errors[overlap_calls] = str(info.value)
        w1 = weights(module)
        assert all(torch.equal(w0[k], w1[k]) for k in w0)  # no step happened
        opt = module.trainer.optimizers[0] if module.trainer.optimizers else None
        assert opt is None or not opt.state  # the optimizer state is as before: empty
    assert errors[True] == errors[False]
    assert "injected failure in backward number 1" in errors[True]


class HookSeesGrads(SeqModule):
    """Records the first weight's gradient in every on_after_backward."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []
        self.owed = []

    def on_after_backward(self):
        self.seen.append(self.net[0][0].weight.grad.detach().clone())
        strategy = self.trainer.strategy
        runtime = getattr(strategy, "runtime", None)
        self.owed.append(runtime is not None and runtime.engine.owed_tail is not None)


@pytest.mark.timeout(90)
def test_on_after_backward_overridden_waits_and_the_hook_sees_complete_gradients():
    ref = HookSeesGrads()
    fit(ref, "auto", max_steps=2, accumulate_grad_batches=2)
    module = HookSeesGrads()
    roundpipe_fit(module, True, max_steps=2, accumulate_grad_batches=2)
    assert module.owed == [False] * 4
    assert len(module.seen) == len(ref.seen) == 4
    for got, want in zip(module.seen, ref.seen):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(60)
def test_the_rule_waits_for_user_hooks_that_may_read_gradients_but_not_for_lightning_callbacks():
    from lightning.pytorch.callbacks import LearningRateMonitor, TQDMProgressBar

    from lightning_roundpipe.lightning.call_overlap import calls_may_overlap

    class ReadsGrads(L.Callback):
        def on_train_batch_end(self, *args):
            pass

    class Trainerish:
        def __init__(self, callbacks):
            self.callbacks = callbacks

    plain = SeqModule()
    assert calls_may_overlap(Trainerish([TQDMProgressBar(), LearningRateMonitor()]), plain)
    assert not calls_may_overlap(Trainerish([ReadsGrads()]), plain)
    assert not calls_may_overlap(Trainerish([]), HookSeesGrads())
    assert not calls_may_overlap(Trainerish([]), SeqModule(manual=True))
