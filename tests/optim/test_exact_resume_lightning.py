"""A Lightning run with staleness=1 resumed from a checkpoint ends where the straight run ends."""

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from _models import SeqModule, make_data, weights
from lightning_roundpipe import RoundPipeStrategy

# The resumed Trainers have no ModelCheckpoint of their own on purpose (they must not write
# checkpoints); Lightning's advice to pass the saving callback again is for real runs.
pytestmark = pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning")

STEPS, SAVED_AT = 6, 3  # 3 batches per epoch: the checkpoint closes an epoch


def _fit(root, strategy, max_steps, opt, ckpt_path=None, callbacks=(), module=None):
    module = module or SeqModule(opt=opt, lr=0.05)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2 if strategy != "auto" else 1,
                        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(callbacks), callbacks=list(callbacks), default_root_dir=str(root))
    trainer.fit(module, DataLoader(make_data(n=24), batch_size=8), ckpt_path=ckpt_path)
    return trainer, module


def _stale():
    return RoundPipeStrategy(microbatches=2, staleness=1)


def _straight_with_checkpoint(tmp_path, opt):
    saver = ModelCheckpoint(dirpath=tmp_path, filename="at-{step}", every_n_train_steps=SAVED_AT, save_top_k=-1)
    _, straight = _fit(tmp_path, _stale(), STEPS, opt, callbacks=[saver])
    return weights(straight), tmp_path / f"at-step={SAVED_AT}.ckpt"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_staleness_one_resume_is_bit_identical_to_the_straight_run(tmp_path, opt):
    straight, ckpt = _straight_with_checkpoint(tmp_path, opt)
    saved = torch.load(ckpt, weights_only=True)
    previous = saved["roundpipe"]["overlapped_optimizers"][0]["previous_weights"]
    assert previous and not all(torch.equal(a, b) for a, b in zip(previous.values(), saved["state_dict"].values()))
    _, resumed = _fit(tmp_path, _stale(), STEPS, opt, ckpt_path=str(ckpt))
    assert all(torch.equal(resumed_w, straight[k]) for k, resumed_w in weights(resumed).items())

    # Without the delayed update's previous weights the run ends elsewhere (what the key fixes), with a warning.
    del saved["roundpipe"]
    torch.save(saved, tmp_path / "bare.ckpt")
    with warnings.catch_warnings(record=True) as caught:  # recorded, not re-emitted (pytest.warns would re-emit others)
        warnings.simplefilter("always")
        _, bare = _fit(tmp_path, _stale(), STEPS, opt, ckpt_path=str(tmp_path / "bare.ckpt"))
    ours = [str(w.message) for w in caught if "lightning_roundpipe" in w.filename]
    assert len(ours) == 1 and "holds no previous weights for staleness=1" in ours[0]
    assert any(not torch.equal(w, straight[k]) for k, w in weights(bare).items())


@pytest.mark.timeout(120)
def test_a_save_after_fit_holds_what_the_checkpoint_during_fit_holds(tmp_path):
    """``trainer.save_checkpoint`` after fit (the runtime is gone by then) keeps the previous weights too.
    (Its resume is not compared with the straight run: Lightning's loops resume a save after fit at
    another batch than a checkpoint taken during fit, under every strategy.)"""
    _, during = _straight_with_checkpoint(tmp_path, "sgd")
    trainer, module = _fit(tmp_path / "b", _stale(), SAVED_AT, "sgd")
    trainer.validate(module, DataLoader(make_data(n=8), batch_size=8), verbose=False)  # changes no weight
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    a, b = (torch.load(p, weights_only=True) for p in (during, tmp_path / "after.ckpt"))
    extra_a, extra_b = (c["roundpipe"]["overlapped_optimizers"][0] for c in (a, b))
    assert extra_a["staleness"] == extra_b["staleness"] == 1
    assert extra_a["previous_weights"].keys() == extra_b["previous_weights"].keys()
    assert all(torch.equal(v, extra_b["previous_weights"][i]) for i, v in extra_a["previous_weights"].items())
    assert all(torch.equal(v, b["state_dict"][k]) for k, v in a["state_dict"].items())
    state_a, state_b = (c["optimizer_states"][0]["state"] for c in (a, b))
    assert all(torch.equal(v["momentum_buffer"], state_b[i]["momentum_buffer"]) for i, v in state_a.items())


@pytest.mark.timeout(120)
def test_the_checkpoint_resumes_under_the_default_strategy(tmp_path):
    _, ckpt = _straight_with_checkpoint(tmp_path, "adamw")
    # the default strategy ignores the extra key: it goes on from the same weights and optimizer state
    ref = SeqModule(opt="adamw", lr=0.05)
    ref.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"])
    _, under_default = _fit(tmp_path, "auto", STEPS, "adamw", ckpt_path=str(ckpt))
    moved = weights(under_default)
    assert any(not torch.equal(moved[k], w) for k, w in weights(ref).items())  # it trained on from the checkpoint
    opt_ref = torch.optim.AdamW([p for p in ref.parameters()], lr=0.005, weight_decay=0.01)
    opt_ref.load_state_dict(torch.load(ckpt, weights_only=True)["optimizer_states"][0])
    data = make_data(n=24).tensors
    for t in range(STEPS - SAVED_AT):
        x, y = data[0][8 * t: 8 * t + 8], data[1][8 * t: 8 * t + 8]
        opt_ref.zero_grad()
        ((ref.net(x) - y) ** 2).mean().backward()
        opt_ref.step()
    assert all(torch.allclose(moved[k], w, rtol=0, atol=1e-6) for k, w in weights(ref).items())


@pytest.mark.timeout(120)
def test_staleness_zero_checkpoints_have_no_extra_key(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path, filename="exact", every_n_train_steps=SAVED_AT)
    _fit(tmp_path, RoundPipeStrategy(microbatches=2, overlap_optimizer=True), SAVED_AT, "sgd", callbacks=[saver])
    ckpt = torch.load(tmp_path / "exact.ckpt", weights_only=True)
    assert "roundpipe" not in ckpt
    _fit(tmp_path / "ref", "auto", SAVED_AT, "sgd",
         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ref", filename="exact", every_n_train_steps=SAVED_AT)])
    assert set(ckpt) == set(torch.load(tmp_path / "ref" / "exact.ckpt", weights_only=True))
