"""Checks of the fine-tuning inputs, run before training so bad input fails fast and clearly.

Each check raises ``FineTuneInputError`` with a message that names the offending value and
the configuration option to change (the Hydra key of ``conf/``, e.g. ``data.seq_len``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..errors import FineTuneInputError


def check_model_path(path: str | Path) -> Path:
    """The model directory as a ``Path``; raises unless it holds a Hugging Face ``config.json``."""
    directory = Path(path).expanduser()
    how_to_get = (
        "Set model.path to a local Hugging Face model directory (config.json + *.safetensors): "
        "download one on a machine with internet access, e.g. "
        "`hf download Qwen/Qwen3-0.6B --local-dir /models/qwen3-0.6b`, and copy it here; "
        "or use the shipped tiny models (model=tiny_qwen3 or model=tiny_llama), which "
        "`python scripts/make_tiny_models.py` regenerates."
    )
    if not directory.exists():
        raise FineTuneInputError(f"model.path {str(directory)!r} does not exist. {how_to_get}")
    if not (directory / "config.json").is_file():
        raise FineTuneInputError(
            f"model.path {str(directory)!r} has no config.json, so it is not a Hugging Face model directory. "
            f"{how_to_get}"
        )
    return directory


def check_tokenizer_fits(tokenizer_size: int, vocab_size: int, tokenizer_source: str) -> None:
    """Every token id the tokenizer can produce must index the model's embedding table."""
    if tokenizer_size > vocab_size:
        raise FineTuneInputError(
            f"tokenizer/model mismatch: the tokenizer from {tokenizer_source!r} has {tokenizer_size} tokens "
            f"but the model's embedding has only vocab_size={vocab_size} rows, so some token ids would "
            "index past it. Set model.tokenizer to the model's own tokenizer (null = the one in model.path), "
            "or pick a model.path whose vocabulary matches."
        )


def check_seq_len(seq_len: int, max_position_embeddings: int | None) -> None:
    """The sequence length must be positive and within the model's position range."""
    if seq_len < 2:
        raise FineTuneInputError(
            f"data.seq_len={seq_len} is too short: next-token training needs at least 2 tokens per sample. "
            "Raise data.seq_len."
        )
    if max_position_embeddings is not None and seq_len > max_position_embeddings:
        raise FineTuneInputError(
            f"data.seq_len={seq_len} is longer than the model's max_position_embeddings="
            f"{max_position_embeddings}. Lower data.seq_len to at most {max_position_embeddings}."
        )


def check_dataset_size(
    num_tokens: int, seq_len: int, batch_size: int, train_blocks: int, val_blocks: int, text_source: str
) -> None:
    """The text must give at least one full training batch and one validation block."""
    if train_blocks >= batch_size and val_blocks >= 1:
        return
    raise FineTuneInputError(
        f"empty dataset: data.text_path {text_source!r} gives {num_tokens} tokens, i.e. {train_blocks} training "
        f"and {val_blocks} validation blocks of data.seq_len={seq_len} tokens, but one training batch needs "
        f"data.batch_size={batch_size} blocks and validation needs at least 1. Use a longer text "
        "(data.text_path), or lower data.seq_len or data.batch_size, or change data.val_fraction."
    )


def check_batch(batch: Mapping[str, Any]) -> None:
    """A batch must hold ``input_ids`` and ``labels`` of one shape (and a matching ``attention_mask``)."""
    missing = [key for key in ("input_ids", "labels") if key not in batch]
    if missing:
        raise FineTuneInputError(
            f"batch lacks {missing}: the data module must yield dicts with input_ids, attention_mask and labels."
        )
    input_shape = tuple(batch["input_ids"].shape)
    for key in ("labels", "attention_mask"):
        value = batch.get(key)
        if value is not None and tuple(value.shape) != input_shape:
            raise FineTuneInputError(
                f"batch {key} shape {tuple(value.shape)} differs from input_ids shape {input_shape}. "
                f"The data module's collate must give {key} the shape of input_ids "
                "(labels = input_ids with -100 where no loss is wanted; see data.padded)."
            )
