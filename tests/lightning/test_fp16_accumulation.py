"""``fp16_accumulation=True``: the reference's precision (fp16 with fp16 matmul accumulation), for one run.

On the CPU: the flag is on while the run trains, off again after it, and refused under a precision
that does not compute in fp16 (before any weight changes). On a GPU: the loss over 300 steps of a
tiny model agrees with bf16-mixed's.
"""

import lightning as L
import pytest
import torch

from _models import SeqModule, fit, make_data, weights
from lightning_roundpipe import OptionError, RoundPipeStrategy
from lightning_roundpipe.lightning.precision import HostScaledMixedPrecision


def flag():
    return torch.backends.cuda.matmul.allow_fp16_accumulation


class FlagDuringSteps(L.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, *args):
        self.seen.append(flag())


@pytest.mark.timeout(60)
def test_the_flag_is_on_for_the_run_and_put_back_after_it():
    assert flag() is False
    cb = FlagDuringSteps()
    fit(SeqModule(), RoundPipeStrategy(microbatches=2, fp16_accumulation=True), devices=2, max_steps=2,
        plugins=[HostScaledMixedPrecision()], callbacks=[cb], record_grads=False)
    assert cb.seen == [True, True]
    assert flag() is False


@pytest.mark.timeout(60)
def test_fp16_accumulation_without_fp16_compute_is_refused_before_any_weight_changes():
    m = SeqModule()
    before = weights(m)
    with pytest.raises(OptionError, match=r"RoundPipeStrategy\(fp16_accumulation=True\) makes fp16 matmuls accumulate "
                                          r"in fp16, but this run computes in the weights' own dtype: use "
                                          r"precision='16-mixed'"):
        fit(m, RoundPipeStrategy(microbatches=2, fp16_accumulation=True), devices=2, max_steps=1, record_grads=False)
    assert all(torch.equal(before[k], v) for k, v in weights(m).items())
    assert flag() is False


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_fp16_accumulation_loss_agrees_with_bf16_over_300_steps():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: fp16 accumulation is a cuBLAS mode")
    from torch.utils.data import DataLoader

    losses = {}
    for name, precision, extra in (("bf16", "bf16-mixed", {}), ("fp16acc", "16-mixed", {"fp16_accumulation": True})):
        m = SeqModule(opt="adamw", width=64, depth=4)

        class Losses(L.Callback):
            def on_train_batch_end(self, trainer, module, outputs, *args):
                losses.setdefault(name, []).append(float(outputs["loss"]))

        trainer = L.Trainer(strategy=RoundPipeStrategy(microbatches=2, **extra), accelerator="gpu", devices=1,
                            max_steps=300, precision=precision, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[Losses()])
        trainer.fit(m, DataLoader(make_data(n=2400, width=64), batch_size=8))
    a, b = torch.tensor(losses["bf16"]), torch.tensor(losses["fp16acc"])
    assert len(a) == len(b) == 300 and torch.isfinite(b).all()
    window = 50  # noise of single steps averaged out: the curves, not the steps, must agree
    mean_a, mean_b = a.unfold(0, window, window).mean(1), b.unfold(0, window, window).mean(1)
    assert ((mean_a - mean_b).abs() / mean_a).max() < 0.05
    assert mean_b[-1] < mean_b[0]  # and it trains
