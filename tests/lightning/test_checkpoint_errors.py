"""Issue 20 item 16: checkpoint files that cannot be used fail with an error naming the file, the
cause and what to do, before anything is loaded or written."""

import collections
import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from _models import SeqModule, make_data
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.lightning import checkpoint_errors
from lightning_roundpipe.lightning.checkpoint_errors import CheckpointError, CheckpointSpaceError
from lightning_roundpipe.lightning.checkpoint_io import AtomicCheckpointIO


def _trainer(root, strategy, max_steps=4):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2 if strategy != "auto" else 1, max_steps=max_steps,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(root))


@pytest.fixture(scope="module")
def sgd_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("sgd")
    t = _trainer(root, "auto", max_steps=2)
    t.fit(SeqModule(opt="sgd"), DataLoader(make_data(), batch_size=8))
    t.save_checkpoint(root / "sgd.ckpt")
    return root / "sgd.ckpt"


def _resume_refused(tmp_path, module, ckpt):
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        _trainer(tmp_path, RoundPipeStrategy()).fit(module, DataLoader(make_data(), batch_size=8), ckpt_path=str(ckpt))
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())  # nothing was loaded
    return str(err.value)


@pytest.mark.parametrize("kept", [0, 0.5])
def test_an_empty_or_truncated_checkpoint_is_refused_naming_it(tmp_path, sgd_checkpoint, kept):
    data = sgd_checkpoint.read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(data[:int(len(data) * kept)])
    # before: EOFError (empty) and OSError: [Errno 22] Invalid argument (truncated), as under the default strategy
    text = _resume_refused(tmp_path, SeqModule(opt="sgd"), cut)
    cause = "is empty (0 bytes)" if kept == 0 else f"is truncated or not a PyTorch checkpoint ({len(data) // 2} bytes"
    assert text.startswith(f"checkpoint {cut} {cause}")
    assert "resume from another checkpoint" in text and "Nothing was loaded" in text


class Unlisted:
    """A class torch.load(weights_only=True) does not allow."""


def test_a_whole_checkpoint_that_fails_for_another_reason_keeps_torchs_error(tmp_path):
    path = tmp_path / "odd.ckpt"  # weights_only=True refuses arbitrary objects: the file is whole, torch says why
    torch.save({"x": Unlisted()}, path)
    with pytest.raises(Exception, match="Weights only load failed") as err:
        AtomicCheckpointIO().load_checkpoint(path, weights_only=True)
    assert not isinstance(err.value, CheckpointError)


def test_an_sgd_checkpoint_resumed_with_adamw_is_refused_before_the_weights_load(tmp_path, sgd_checkpoint):
    # before: KeyError: 'step' from Adam's __setstate__, after the weights were loaded (the default strategy still does)
    text = _resume_refused(tmp_path, SeqModule(opt="adamw"), sgd_checkpoint)
    assert text.startswith("the checkpoint's optimizer state does not load into this run's optimizer 0 (AdamW): "
                           "KeyError: 'step' (its saved per-parameter state holds ['momentum_buffer'])")
    assert "resume with the optimizer set-up that saved it" in text and "Nothing was loaded" in text


def test_the_same_optimizer_resumes_as_before(tmp_path, sgd_checkpoint):
    m = SeqModule(opt="sgd")
    t = _trainer(tmp_path, RoundPipeStrategy(), max_steps=3)
    t.fit(m, DataLoader(make_data(), batch_size=8), ckpt_path=str(sgd_checkpoint))
    assert t.global_step == 3


def _previous(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"version": 1, "w": torch.ones(4)}, path)
    return path


def test_a_disk_that_fills_during_a_save_is_named_and_the_previous_checkpoint_is_intact(tmp_path, monkeypatch):
    path = _previous(tmp_path)
    real_fdopen = os.fdopen

    def full_disk(fd, *args, **kwargs):  # the temporary file is created; its writes hit a full device
        os.close(fd)
        return real_fdopen(os.open("/dev/full", os.O_WRONLY), *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", full_disk)
    # before: RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos 704 vs 598
    with pytest.raises(CheckpointSpaceError) as err:
        AtomicCheckpointIO().save_checkpoint({"version": 2, "w": torch.zeros(1 << 16)}, path)
    monkeypatch.undo()
    assert str(err.value).startswith(f"no space left on the device while saving the checkpoint {path}: free some space")
    assert f"the previous checkpoint {path} is intact" in str(err.value) and err.value.errno == 28
    assert os.listdir(tmp_path) == ["last.ckpt"]  # the partial file is gone
    assert torch.load(path)["version"] == 1


def test_a_save_larger_than_the_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    path = _previous(tmp_path)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint_errors.shutil, "disk_usage", lambda d: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(CheckpointSpaceError) as err:
        AtomicCheckpointIO().save_checkpoint({"version": 2, "w": torch.zeros(1 << 16)}, path)
    assert str(err.value).startswith(f"no space left for the checkpoint {path}: it needs at least 262144 bytes and "
                                     f"{tmp_path} has 1000 free")
    assert f"Nothing was written: the previous checkpoint {path} is intact" in str(err.value)
    assert os.listdir(tmp_path) == ["last.ckpt"] and torch.load(path)["version"] == 1
