"""Mixed precision with host masters, and checkpoint/resume."""

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from _models import SeqModule, fit, make_data, weights
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.lightning.checkpoint_io import AtomicCheckpointIO
from lightning_roundpipe.lightning.precision import HostScaledMixedPrecision


def test_bf16_mixed_tracks_default_over_20_steps():
    """Tolerance 2e-2 relative per tensor: both runs compute matmuls in bf16 (8-bit mantissa,
    relative rounding ~4e-3), but on different microbatch shapes, and the pipeline's gradients
    come back in bf16 per microbatch; over 20 AdamW steps these roundings differ, not the maths."""
    ref, got = SeqModule(opt="adamw"), SeqModule(opt="adamw")
    w0 = weights(ref)
    data = make_data(n=160)
    fit(ref, "auto", max_steps=20, precision="bf16-mixed", data=data)
    fit(got, RoundPipeStrategy(microbatches=2), devices=2, max_steps=20, precision="bf16-mixed", data=data)
    w_ref, w = weights(ref), weights(got)
    for k in w:
        assert ((w[k] - w_ref[k]).norm() / w_ref[k].norm()).item() < 2e-2
        assert ((w[k] - w_ref[k]).norm() / (w_ref[k] - w0[k]).norm()).item() < 0.25  # the update itself agrees


class Overflow(L.Callback):
    """Puts an inf into one gradient at one step (what an fp16 overflow looks like)."""

    def __init__(self, step):
        self.step, self.before, self.after = step, None, None

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.step:
            self.before = weights(pl_module)
            next(pl_module.parameters()).grad[0, 0] = float("inf")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.before is not None and self.after is None:
            trainer.strategy.join()
            self.after = weights(pl_module)


def test_fp16_loss_scaling_skips_the_step_on_overflow():
    m = SeqModule(opt="adamw")
    cb = Overflow(step=2)
    plugin = HostScaledMixedPrecision()
    trainer, _ = fit(m, RoundPipeStrategy(microbatches=2), devices=2, max_steps=4, plugins=[plugin],
                     callbacks=[cb], record_grads=False)
    assert all(torch.equal(cb.before[k], cb.after[k]) for k in cb.before)  # the overflowing step touched nothing
    assert plugin.scaler.get_scale() == 2.0**15  # halved once
    assert trainer.global_step == 4


def _trainer(tmp_path, max_steps=-1, strategy=None, **kw):
    return L.Trainer(strategy=strategy or RoundPipeStrategy(microbatches=2), accelerator="cpu", devices=2,
                     max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path), **kw)


def test_resume_is_exact_bit_for_bit(tmp_path):
    """6 steps straight, or 3 steps (one epoch), save, resume to 6: the same weights, bit for bit.

    The first run stops at the epoch boundary by max_epochs: a run stopped by max_steps at the
    last batch of an epoch is resumed by Lightning at one more batch of that epoch (Lightning's
    own behaviour, the same under its default strategy).
    """
    data = DataLoader(make_data(n=24), batch_size=8)  # 3 steps per epoch
    straight = SeqModule(opt="adamw", scheduler=True)
    _trainer(tmp_path, max_epochs=2, gradient_clip_val=0.05).fit(straight, data)

    first = SeqModule(opt="adamw", scheduler=True)
    t = _trainer(tmp_path, max_epochs=1, gradient_clip_val=0.05)
    t.fit(first, data)
    assert t.global_step == 3
    ckpt = tmp_path / "half.ckpt"
    t.save_checkpoint(ckpt)
    resumed = SeqModule(opt="adamw", scheduler=True)
    t2 = _trainer(tmp_path, max_epochs=2, gradient_clip_val=0.05)
    t2.fit(resumed, data, ckpt_path=str(ckpt))
    assert t2.global_step == 6
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_loads_plainly_and_under_the_default_strategy(tmp_path):
    data = DataLoader(make_data(n=24), batch_size=8)
    m = SeqModule(opt="adamw")
    t = _trainer(tmp_path, max_epochs=1)  # ends at the epoch boundary: the resume needs no mid-epoch loader state
    t.fit(m, data)
    assert t.global_step == 3
    ckpt = tmp_path / "m.ckpt"
    t.save_checkpoint(ckpt)
    raw = torch.load(ckpt, weights_only=False)
    assert set(raw["state_dict"]) == set(m.state_dict())
    assert raw["optimizer_states"][0]["state"]  # AdamW moments saved
    other = SeqModule(opt="adamw", seed=5)
    L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(other, data, ckpt_path=str(ckpt))
    assert other.trainer.global_step == 4  # resumed at step 3, one more step


def test_atomic_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"version": 1}, path)

    def broken_save(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"version": 2}, path)
    monkeypatch.undo()
    assert torch.load(path)["version"] == 1
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no temporary file left behind


def test_lora_checkpoint_holds_only_trainable_weights(tmp_path):
    """The small checkpoint, asked for with checkpoint_weights="trainable" (the default saves everything)."""
    from tests.adapters.test_hf_pipeline import LoraFineTune, batch

    ids, mask, labels = batch(padded=False)
    data = DataLoader([{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(5)], batch_size=5)
    m = LoraFineTune()
    t = _trainer(tmp_path, 2, strategy=RoundPipeStrategy(microbatches=2, checkpoint_weights="trainable"))
    t.fit(m, data)
    ckpt = tmp_path / "lora.ckpt"
    t.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert set(state) == trainable and all("lora_" in k for k in state)
    # and it restores into a fresh module built from the same base model
    fresh = LoraFineTune()
    t2 = _trainer(tmp_path, 3)
    t2.fit(fresh, data, ckpt_path=str(ckpt))
    assert t2.global_step == 3


@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_true_precisions_train_like_the_default_strategy(precision):
    ref, got = SeqModule(opt="sgd"), SeqModule(opt="sgd")
    w0 = weights(got)
    fit(ref, "auto", max_steps=3, precision=precision)
    fit(got, RoundPipeStrategy(microbatches=2), devices=2, max_steps=3, precision=precision)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert all(p.dtype == dtype for p in got.parameters())  # masters live on the host in that dtype
    w, w_ref = weights(got), weights(ref)
    tol = 0.1 if precision == "bf16-true" else 1e-4  # bf16 rounding of the updates themselves
    for k in w:
        assert ((w[k].float() - w_ref[k].float()).norm() / (w_ref[k].float() - w0[k].float()).norm()).item() <= tol
