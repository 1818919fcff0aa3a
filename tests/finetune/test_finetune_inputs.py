"""Bad fine-tuning input fails before training, with a message that names the option to change."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer

from lightning_roundpipe import assets
from lightning_roundpipe.finetune import CausalLMFineTune, FineTuneInputError, TextDataModule
from lightning_roundpipe.finetune.checks import check_batch
from lightning_roundpipe.finetune.config import register_resolvers

REPO = Path(__file__).resolve().parents[2]
TINY = assets.path("tiny-qwen3")

register_resolvers()


@pytest.fixture
def run_job(tmp_path, monkeypatch):
    """Runs examples/finetune.py with overrides; fails the test if training ever starts."""
    spec = importlib.util.spec_from_file_location("finetune_example", REPO / "examples" / "finetune.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def no_training(*args, **kwargs):
        raise AssertionError("training started despite bad input")

    monkeypatch.setattr(pl.Trainer, "fit", no_training)
    monkeypatch.setattr(pl.Trainer, "validate", no_training)

    def run(*overrides: str):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=["strategy=default", f"out_dir={tmp_path / 'out'}", *overrides])
        example.main(cfg)

    return run


@pytest.fixture
def big_tokenizer(tmp_path) -> Path:
    """The tiny models' tokenizer with 8 extra tokens: 520 > the embedding's 512 rows."""
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(8)])
    tokenizer.save_pretrained(tmp_path / "big_tokenizer")
    return tmp_path / "big_tokenizer"


@pytest.fixture
def short_text(tmp_path) -> Path:
    path = tmp_path / "short.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 20)
    return path


def test_missing_model_path_names_the_path_and_how_to_get_a_model(run_job):
    with pytest.raises(FineTuneInputError) as error:
        run_job("model.path=/nowhere/qwen3")
    message = str(error.value)
    assert "model.path '/nowhere/qwen3' does not exist" in message
    assert "hf download" in message and "scripts/make_tiny_models.py" in message


def test_model_path_without_config_is_rejected(tmp_path):
    with pytest.raises(FineTuneInputError, match=r"has no config.json, so it is not a Hugging Face model directory"):
        CausalLMFineTune(tmp_path)
    with pytest.raises(FineTuneInputError, match=r"model.path .* does not exist"):
        TextDataModule(tmp_path / "absent")


def test_real_model_without_path_is_rejected_before_loading(run_job):
    with pytest.raises(FineTuneInputError, match=r"required config values not set: model.path\."):
        run_job("model=qwen3_8b")


def test_tokenizer_larger_than_embedding_is_a_mismatch(run_job, big_tokenizer):
    with pytest.raises(FineTuneInputError) as error:
        run_job(f"model.tokenizer={big_tokenizer}")
    message = str(error.value)
    assert message.startswith("tokenizer/model mismatch")
    assert "has 520 tokens but the model's embedding has only vocab_size=512 rows" in message
    assert "Set model.tokenizer" in message


def test_seq_len_beyond_max_positions(run_job):
    with pytest.raises(FineTuneInputError) as error:
        run_job("data.seq_len=1024")
    assert str(error.value) == (
        "data.seq_len=1024 is longer than the model's max_position_embeddings=512. "
        "Lower data.seq_len to at most 512."
    )


def test_text_too_short_for_one_batch_is_an_empty_dataset(run_job, short_text):
    # 20 lines are about 300 tokens: 2 blocks of 128, so no batch of 8.
    with pytest.raises(FineTuneInputError) as error:
        run_job(f"data.text_path={short_text}")
    message = str(error.value)
    assert message.startswith(f"empty dataset: data.text_path '{short_text}' gives ")
    assert "one training batch needs data.batch_size=8 blocks" in message
    assert "lower data.seq_len or data.batch_size" in message


def test_missing_text_file(run_job, tmp_path):
    with pytest.raises(FineTuneInputError, match=r"data.text_path '.*nothing.txt' is not a file"):
        run_job(f"data.text_path={tmp_path / 'nothing.txt'}")


class ShortLabels(TextDataModule):
    """A data module with a collate bug: labels one token shorter than input_ids."""

    def train_dataloader(self):
        def collate(samples):
            batch = torch.utils.data.default_collate(samples)
            batch["labels"] = batch["labels"][:, :-1]
            return batch

        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, collate_fn=collate)


def test_labels_shape_differing_from_input_ids_fails_before_any_weight_changes():
    data = ShortLabels(TINY, seq_len=32, batch_size=4)
    module = CausalLMFineTune(TINY)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    with pytest.raises(FineTuneInputError) as error:
        trainer.fit(module, datamodule=data)
    assert str(error.value).startswith("batch labels shape (4, 31) differs from input_ids shape (4, 32).")
    assert trainer.global_step == 0
    for name, p in module.named_parameters():
        assert torch.equal(p, before[name]), name


def test_batch_check_messages_are_distinct():
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(FineTuneInputError, match=r"batch lacks \['labels'\]"):
        check_batch({"input_ids": ids})
    with pytest.raises(FineTuneInputError, match=r"batch attention_mask shape \(2, 7\) differs"):
        check_batch({"input_ids": ids, "labels": ids, "attention_mask": ids[:, 1:]})
    check_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})  # fine


def test_bad_options_name_their_key():
    with pytest.raises(FineTuneInputError, match=r"data.val_fraction=1.5 must be in \[0, 1\)"):
        TextDataModule(TINY, val_fraction=1.5)
    with pytest.raises(FineTuneInputError, match=r"data.seq_len=1 is too short"):
        TextDataModule(TINY, seq_len=1)
    with pytest.raises(FineTuneInputError, match=r"unknown lora options \['rank'\]"):
        CausalLMFineTune(TINY, lora={"enabled": True, "rank": 4})
    with pytest.raises(FineTuneInputError, match=r"optim.schedule='cosine'; choose 'linear' or 'constant'"):
        CausalLMFineTune(TINY, optim={"schedule": "cosine"})
    with pytest.raises(FineTuneInputError, match=r"model.dtype='bf16' is not a torch dtype"):
        CausalLMFineTune(TINY, dtype="bf16")
    assert CausalLMFineTune(TINY, dtype="bfloat16").model.dtype == torch.bfloat16
