"""Checkpoints load exactly as strictly as under Lightning's default strategy, LoRA runs resume anywhere,
and interrupted saves leave nothing behind."""

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from _models import SeqModule, make_data
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.lightning.checkpoint_io import AtomicCheckpointIO


def _trainer(root, strategy, max_steps=2, devices=None):
    devices = devices or (2 if strategy != "auto" else 1)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(root))


def _saved(tmp_path, module, name="m.ckpt"):
    data = DataLoader(make_data(), batch_size=8)
    t = _trainer(tmp_path, "auto")
    t.fit(module, data)
    path = tmp_path / name
    t.save_checkpoint(path)
    return path


def _error(fn):
    with pytest.raises(Exception) as err:
        fn()
    return type(err.value), str(err.value)


@pytest.mark.parametrize("entry", ["validate", "fit"])
@pytest.mark.parametrize("saved_depth,loaded_depth", [(5, 4), (4, 5)])
def test_another_models_checkpoint_fails_like_under_the_default_strategy(tmp_path, entry, saved_depth, loaded_depth):
    ckpt = _saved(tmp_path, SeqModule(depth=saved_depth))
    data = DataLoader(make_data(), batch_size=8)

    def load(strategy):
        m = SeqModule(depth=loaded_depth)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        t = _trainer(tmp_path, strategy, max_steps=3)
        call = (lambda: t.validate(m, data, ckpt_path=str(ckpt))) if entry == "validate" else \
            (lambda: t.fit(m, data, ckpt_path=str(ckpt)))
        result = _error(call)
        return result, m, before

    expected, _, _ = load("auto")
    got, module, before = load(RoundPipeStrategy(microbatches=2))
    assert got == expected  # same exception type, same message
    assert "Unexpected key(s)" in got[1] or "Missing key(s)" in got[1]
    assert "forward" not in vars(module.net)
    if entry == "fit":  # refused before any weight changed
        assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


def test_shape_mismatch_fails_like_under_the_default_strategy(tmp_path):
    ckpt = _saved(tmp_path, SeqModule(width=8))
    data = DataLoader(make_data(width=6), batch_size=8)
    results = [_error(lambda s=s: _trainer(tmp_path, s).validate(SeqModule(width=6), data, ckpt_path=str(ckpt)))
               for s in ("auto", RoundPipeStrategy(microbatches=2))]
    assert results[0] == results[1] and "size mismatch" in results[1][1]


def test_non_strict_loading_is_as_lenient_as_the_default_strategy():
    ref, got = SeqModule(depth=4), SeqModule(depth=4)
    state = SeqModule(depth=4, seed=3).state_dict()
    del state["net.0.0.bias"]
    state["net.9.weight"] = torch.zeros(2)
    ref.load_state_dict(state, strict=False)  # what the default strategy does with strict=False
    s = RoundPipeStrategy()
    s.connect(got)
    s.load_model_state_dict({"state_dict": state}, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), got.state_dict().values()))
    assert not torch.equal(got.net[0][0].weight, SeqModule(depth=4).net[0][0].weight)


def _lora_data():
    from tests.adapters.test_hf_pipeline import batch

    ids, mask, labels = batch(padded=False)
    return DataLoader([{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(5)],
                      batch_size=5)


def test_lora_checkpoint_resumes_under_the_default_strategy_with_no_extra_code(tmp_path):
    from tests.adapters.test_hf_pipeline import LoraFineTune

    torch.manual_seed(0)
    m = LoraFineTune()
    t = _trainer(tmp_path, RoundPipeStrategy(microbatches=2), max_steps=2)
    t.fit(m, _lora_data())
    ckpt = tmp_path / "lora_full.ckpt"
    t.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert set(state) == set(m.state_dict())  # the full state, as the default strategy saves it
    torch.manual_seed(1)  # a fresh module with other LoRA weights: the checkpoint must bring them back
    fresh = LoraFineTune()
    t2 = _trainer(tmp_path, "auto", max_steps=2)  # the checkpoint is at step 2: restores, trains nothing
    t2.fit(fresh, _lora_data(), ckpt_path=str(ckpt))
    trained = m.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in fresh.state_dict().items())
    t3 = _trainer(tmp_path, "auto", max_steps=3)
    t3.fit(LoraFineTune(), _lora_data(), ckpt_path=str(ckpt))
    assert t3.global_step == 3


def test_trainable_only_checkpoint_still_refuses_unexpected_keys(tmp_path):
    from tests.adapters.test_hf_pipeline import LoraFineTune

    torch.manual_seed(0)
    m = LoraFineTune()
    s = RoundPipeStrategy(checkpoint_weights="trainable")
    s.connect(m)
    small = s.lightning_module_state_dict()
    assert small and all("lora_" in k for k in small)
    s.load_model_state_dict({"state_dict": small}, strict=True)  # frozen base absent: the documented case
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"extra.weight\""):
        s.load_model_state_dict({"state_dict": {**small, "extra.weight": torch.zeros(1)}}, strict=True)
    lora_key = next(iter(small))
    with pytest.raises(RuntimeError, match="Missing key"):
        s.load_model_state_dict({"state_dict": {k: v for k, v in small.items() if k != lora_key}}, strict=True)


def test_interrupted_saves_are_cleaned_up_on_the_next_save(tmp_path):
    leftovers = [tmp_path / ".tmp-last.ckpt-k2j4h1", tmp_path / ".tmp-epoch=0-step=3.ckpt-a8b7c6"]
    for p in leftovers:
        p.write_bytes(b"half a checkpoint")
    keep = tmp_path / "notes.txt"
    keep.write_text("not ours")
    AtomicCheckpointIO().save_checkpoint({"version": 3}, tmp_path / "epoch=1-step=6.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["epoch=1-step=6.ckpt", "notes.txt"]
    assert torch.load(tmp_path / "epoch=1-step=6.ckpt")["version"] == 3


def test_a_key_of_a_non_persistent_buffer_is_unexpected_as_in_pytorch():
    class WithScratch(SeqModule):
        def __init__(self):
            super().__init__()
            self.net[0].register_buffer("scratch", torch.zeros(2), persistent=False)

    m = WithScratch()
    state = {**m.state_dict(), "net.0.scratch": torch.ones(2)}
    expected = _error(lambda: WithScratch().load_state_dict(state, strict=True))
    s = RoundPipeStrategy()
    s.connect(m)
    assert _error(lambda: s.load_model_state_dict({"state_dict": state}, strict=True)) == expected
    assert torch.equal(m.net[0].scratch, torch.zeros(2))
