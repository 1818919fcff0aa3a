"""optimizer_undo=False under Lightning: a failed step says what it left updated, and the module
can be neither trained nor saved until a checkpoint restores it."""

import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from _exact_models import LAYERED, our_threads
from _models import SeqModule, make_data, weights
from lightning_roundpipe import PipelineError, RoundPipeRuntime, RoundPipeStrategy
from lightning_roundpipe.options import OptionError

FAIL_STEP = 2


class FailingSGD(torch.optim.SGD):
    """Raises for the parameter group marked ``fail`` on its ``fail_on``-th step (counting from 0).

    Counted here, not armed from a hook: the layer steps run on the optimizer lane, behind the
    next batch's hooks."""

    roundpipe_per_layer = True  # its state is per parameter: it may be stepped layer by layer

    fail_on = None
    calls = 0

    def step(self, closure=None):
        if any(g.get("fail") for g in self.param_groups):
            call, FailingSGD.calls = FailingSGD.calls, FailingSGD.calls + 1
            if call == FailingSGD.fail_on:
                raise RuntimeError("injected optimizer failure for one parameter group")
        return super().step(closure)


class FailingModule(SeqModule):
    def __init__(self, fail=True):
        super().__init__(lr=0.05)
        self.fail = fail

    def configure_optimizers(self):
        FailingSGD.calls, FailingSGD.fail_on = 0, FAIL_STEP if self.fail else None
        params = list(self.parameters())
        # the lowest layers fail: with early steps the upper layers have stepped during backward by then
        return FailingSGD([{"params": params[:2], "fail": True}, {"params": params[2:]}], lr=0.05, momentum=0.9)


def _trainer(root, strategy, max_steps=4, callbacks=()):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=max_steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(callbacks),
                     callbacks=list(callbacks), default_root_dir=str(root))


def _data():
    return DataLoader(make_data(n=24), batch_size=8)


def test_optimizer_undo_is_a_validated_strategy_option():
    assert RoundPipeStrategy().options.optimizer_undo is True
    assert RoundPipeStrategy(optimizer_undo=False).options.runtime_options().optimizer_undo is False
    with pytest.raises(OptionError, match="optimizer_undo"):
        RoundPipeStrategy(optimizer_undo="no")


@pytest.mark.timeout(120)
# The failure is mid-epoch, so the good checkpoint is too, and the resumed Trainers do not save:
# Lightning's advice for real runs (resumable loaders, the saving callback again) does not apply.
@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning")
def test_without_undo_the_module_is_refused_until_a_checkpoint_restores_it(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path, filename="good", every_n_train_steps=FAIL_STEP)
    module = FailingModule()
    with pytest.raises(RuntimeError, match="injected optimizer failure") as failed:
        _trainer(tmp_path, RoundPipeStrategy(microbatches=2, optimizer_undo=False, **LAYERED), callbacks=[saver]).fit(
            module, _data())
    text = str(failed.value)
    assert "step failed in layer 0" in text and "not put back" in text and "layer 5" in text
    good = torch.load(tmp_path / "good.ckpt", weights_only=True)["state_dict"]
    partly = weights(module)
    changed = {k for k in partly if not torch.equal(partly[k], good[k])}
    assert changed and changed != set(partly)  # some layers stepped, the failing ones did not
    deadline = time.monotonic() + 5
    while our_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert our_threads() == [] and "forward" not in vars(module.net)

    # training on or saving that state is refused, naming what is updated, without touching a weight
    module.fail = False
    again = _trainer(tmp_path, RoundPipeStrategy(microbatches=2, optimizer_undo=False, **LAYERED))
    with pytest.raises(PipelineError, match=r"cannot train: FailingModule is partly updated: .*layer 5.*ckpt_path"):
        again.fit(module, _data())
    with pytest.raises(PipelineError, match="cannot save a checkpoint"):
        again.save_checkpoint(tmp_path / "partial.ckpt")
    assert not (tmp_path / "partial.ckpt").exists()
    assert all(torch.equal(v, partly[k]) for k, v in weights(module).items())
    assert "forward" not in vars(module.net)

    # fit(ckpt_path=...) restores it and trains on exactly as a run that never failed
    _trainer(tmp_path, RoundPipeStrategy(microbatches=2, optimizer_undo=False, **LAYERED)).fit(
        module, _data(), ckpt_path=str(tmp_path / "good.ckpt"))
    reference = FailingModule(fail=False)
    _trainer(tmp_path, RoundPipeStrategy(microbatches=2, **LAYERED)).fit(reference, _data(), ckpt_path=str(tmp_path / "good.ckpt"))
    assert all(torch.equal(w, weights(reference)[k]) for k, w in weights(module).items())


@pytest.mark.timeout(120)
def test_with_undo_the_same_failure_leaves_the_module_trainable(tmp_path):
    module = FailingModule()
    with pytest.raises(RuntimeError, match="injected optimizer failure"):
        _trainer(tmp_path, RoundPipeStrategy(microbatches=2, **LAYERED)).fit(module, _data())
    RoundPipeRuntime.refuse_if_partly_updated(module, "train")  # nothing recorded: the step was put back
    module.fail = False
    _trainer(tmp_path, RoundPipeStrategy(microbatches=2, **LAYERED), max_steps=1).fit(module, _data())


@pytest.mark.timeout(60)
def test_plain_pytorch_attach_is_refused_until_mark_restored():
    from lightning_roundpipe import RuntimeOptions

    module = FailingModule()
    net = module.net
    module.fail = False
    opt = module.configure_optimizers()
    FailingSGD.fail_on = 0
    options = RuntimeOptions(microbatches=2, step_metrics=False, optimizer_undo=False, **LAYERED)
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, options)
    ov = runtime.overlap_optimizer(opt)  # undo comes from the options
    assert ov.keep_undo is False
    x, y = make_data(n=8).tensors
    try:
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        with pytest.raises(PipelineError, match="not put back"):
            opt.step()
            runtime.join()
    finally:
        runtime.detach()
    with pytest.raises(PipelineError, match="cannot train: Sequential is partly updated"):
        RoundPipeRuntime.attach(net, "cpu", 2, options)
    assert "forward" not in vars(net)
    RoundPipeRuntime.mark_restored(net)
    RoundPipeRuntime.attach(net, "cpu", 2, options).detach()
