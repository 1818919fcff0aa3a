"""Checkpoint integrity (issue 43, item 13): with ``verify_checkpoints=True`` a checkpoint whose bytes
changed after it was written (one flipped bit in a weight) is refused before anything loads, with
an error naming the file; without it, it loads silently, as under Lightning's default strategy."""

import zipfile

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from _models import SeqModule, make_data
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.lightning.checkpoint_errors import CheckpointError
from lightning_roundpipe.lightning.checkpoint_integrity import CheckpointIntegrityError, verify_archive
from lightning_roundpipe.options import OptionError


def _trainer(root, strategy, max_steps=2):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2 if strategy != "auto" else 1, max_steps=max_steps,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(root))


def flip_one_bit(path, entry_suffix, byte=5, bit=3):
    """Flip bit ``bit`` of byte ``byte`` of the stored bytes of the archive entry ending in ``entry_suffix``."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(entry_suffix))
    data = bytearray(path.read_bytes())
    name_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little")
    extra_len = int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    data[info.header_offset + 30 + name_len + extra_len + byte] ^= 1 << bit
    path.write_bytes(bytes(data))
    return info.filename


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint written by RoundPipe after 2 AdamW steps, and a copy with one bit of one weight flipped."""
    root = tmp_path_factory.mktemp("integrity")
    trainer = _trainer(root, RoundPipeStrategy(microbatches=2, overlap_optimizer=True))
    trainer.fit(SeqModule(opt="adamw"), DataLoader(make_data(), batch_size=8))
    whole = root / "whole.ckpt"
    trainer.save_checkpoint(whole)
    flipped = root / "flipped.ckpt"
    flipped.write_bytes(whole.read_bytes())
    entry = flip_one_bit(flipped, "data/0")
    return whole, flipped, entry


@pytest.mark.timeout(90)
def test_a_flipped_bit_loads_silently_without_the_check(saved):
    whole, flipped, _ = saved
    a, b = torch.load(whole, weights_only=False)["state_dict"], torch.load(flipped, weights_only=False)["state_dict"]
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    assert len(changed) == 1  # one tensor differs by one bit, and nothing said so
    module = SeqModule(opt="adamw")
    _trainer(whole.parent, RoundPipeStrategy(microbatches=2), max_steps=3).fit(
        module, DataLoader(make_data(), batch_size=8), ckpt_path=str(flipped))


@pytest.mark.timeout(90)
def test_a_flipped_bit_is_refused_with_the_file_named_and_nothing_loaded(saved, tmp_path):
    whole, flipped, entry = saved
    module = SeqModule(opt="adamw")
    before = {k: v.clone() for k, v in module.state_dict().items()}
    strategy = RoundPipeStrategy(microbatches=2, verify_checkpoints=True)
    with pytest.raises(CheckpointIntegrityError) as err:
        _trainer(tmp_path, strategy, max_steps=3).fit(module, DataLoader(make_data(), batch_size=8),
                                                      ckpt_path=str(flipped))
    text = str(err.value)
    assert text.startswith(f"checkpoint {flipped} is corrupt: its entry {entry!r}")
    assert "fails its CRC-32 check" in text and "verify_checkpoints=False" in text
    assert isinstance(err.value, CheckpointError)
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())


@pytest.mark.timeout(90)
def test_a_whole_checkpoint_resumes_with_the_check_on(saved, tmp_path):
    whole, _, _ = saved
    assert verify_archive(whole) == len(zipfile.ZipFile(whole).infolist())
    trainer = _trainer(tmp_path, RoundPipeStrategy(microbatches=2, verify_checkpoints=True), max_steps=3)
    trainer.fit(SeqModule(opt="adamw"), DataLoader(make_data(), batch_size=8), ckpt_path=str(whole))
    assert trainer.global_step == 3


def test_a_flipped_bit_in_the_pickled_dict_is_refused(tmp_path):
    path = tmp_path / "pickle.ckpt"
    torch.save({"step": 7, "w": torch.ones(4)}, path)
    entry = flip_one_bit(path, "data.pkl", byte=2, bit=0)
    with pytest.raises(CheckpointIntegrityError, match=f"checkpoint {path} is corrupt: its entry '{entry}'"):
        verify_archive(path)


def test_a_legacy_checkpoint_has_no_checksums_to_check(tmp_path):
    path = tmp_path / "legacy.ckpt"
    torch.save({"w": torch.ones(4)}, path, _use_new_zipfile_serialization=False)
    assert verify_archive(path) == 0


def test_the_option_is_a_checked_flag_and_off_by_default():
    assert RoundPipeStrategy().checkpoint_io.verify is False
    assert RoundPipeStrategy(verify_checkpoints=True).checkpoint_io.verify is True
    with pytest.raises(OptionError, match="verify_checkpoints"):
        RoundPipeStrategy(verify_checkpoints="yes")
