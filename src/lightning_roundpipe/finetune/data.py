"""A text file as a causal-LM data module: tokenized once, cut into blocks, split train/val.

The whole text is tokenized as one stream with the model's own tokenizer and cut into
``seq_len``-token blocks (the tail that does not fill a block is dropped). The last
``val_fraction`` of the blocks is the validation set, so validation text is text the training
batches never contain. Every sample is a dict of ``input_ids``, ``attention_mask`` and
``labels`` (= ``input_ids``; the model shifts them). With ``padded=True`` each block is cut to a
seeded random length and right-padded, with ``attention_mask`` 0 and ``labels`` -100 on the
padding, to exercise variable-length batches.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoTokenizer

from .. import assets
from .checks import FineTuneInputError, check_dataset_size, check_model_path, check_seq_len, check_tokenizer_fits

IGNORE_INDEX = -100  # label value that Hugging Face losses skip


class BlockDataset(Dataset):
    """Rows of three equally shaped tensors, served as dicts."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.labels = labels

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "labels": self.labels[index],
        }


def cut_blocks(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``ids`` (1-D) as a ``[num_blocks, seq_len]`` tensor; the incomplete tail is dropped."""
    num_blocks = ids.numel() // seq_len
    return ids[: num_blocks * seq_len].reshape(num_blocks, seq_len)


def split_count(num_blocks: int, val_fraction: float) -> int:
    """How many of ``num_blocks`` go to validation: the rounded fraction, at least one if any exist."""
    if num_blocks == 0:
        return 0
    return min(num_blocks, max(1, round(num_blocks * val_fraction)))


def padded_samples(
    blocks: torch.Tensor, pad_id: int, min_len: int, generator: torch.Generator
) -> BlockDataset:
    """Each block cut to a random length in ``[min_len, seq_len]`` and right-padded with ``pad_id``."""
    count, seq_len = blocks.shape
    lengths = torch.randint(min_len, seq_len + 1, (count,), generator=generator)
    keep = torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)
    input_ids = torch.where(keep, blocks, torch.full_like(blocks, pad_id))
    labels = torch.where(keep, blocks, torch.full_like(blocks, IGNORE_INDEX))
    return BlockDataset(input_ids, keep.long(), labels)


def full_samples(blocks: torch.Tensor) -> BlockDataset:
    """Each block as one sample: every token attended to and predicted."""
    return BlockDataset(blocks, torch.ones_like(blocks), blocks.clone())


class TextDataModule(pl.LightningDataModule):
    """Causal-LM batches from a text file, tokenized with the model's tokenizer.

    Args:
        model_path: the Hugging Face model directory whose tokenizer and limits apply.
        text_path: the text to train on; ``None`` = the shipped Shakespeare excerpt.
        tokenizer: a tokenizer directory to use instead of the model's own (``None`` = ``model_path``).
        seq_len: tokens per sample; at most the model's ``max_position_embeddings``.
        batch_size: samples per batch (training batches are always full).
        val_fraction: share of the blocks, taken from the end of the text, used for validation.
        padded: make variable-length samples, right-padded (attention_mask 0, labels -100).
        min_len_fraction: with ``padded``, the shortest sample as a fraction of ``seq_len``.
        seed: seeds the shuffling and the padded lengths.
        num_workers: DataLoader worker processes.

    Bad input (missing model, tokenizer larger than the embedding, ``seq_len`` beyond the
    model's positions, text too short for one batch) raises ``FineTuneInputError``: the first
    three on construction, the last in ``setup``, both before training starts.
    """

    def __init__(
        self,
        model_path: str | Path,
        text_path: str | Path | None = None,
        tokenizer: str | Path | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.1,
        padded: bool = False,
        min_len_fraction: float = 0.5,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model_path = check_model_path(model_path)
        self.text_path = Path(text_path).expanduser() if text_path is not None else assets.path("shakespeare.txt")
        if not self.text_path.is_file():
            raise FineTuneInputError(f"data.text_path {str(self.text_path)!r} is not a file; point it at a text file.")
        if not 0.0 <= val_fraction < 1.0:
            raise FineTuneInputError(f"data.val_fraction={val_fraction} must be in [0, 1).")
        tokenizer_source = str(tokenizer) if tokenizer is not None else str(self.model_path)
        self.model_config = AutoConfig.from_pretrained(self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
        check_tokenizer_fits(len(self.tokenizer), self.model_config.vocab_size, tokenizer_source)
        check_seq_len(seq_len, getattr(self.model_config, "max_position_embeddings", None))
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.padded = padded
        self.min_len_fraction = min_len_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: BlockDataset | None = None
        self.val_set: BlockDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Tokenize and split once; later calls (Lightning calls it per stage) reuse the result."""
        if self.train_set is not None:
            return
        text = self.text_path.read_text(encoding="utf-8")
        ids = torch.tensor(self.tokenizer(text, verbose=False)["input_ids"], dtype=torch.long)
        blocks = cut_blocks(ids, self.seq_len)
        num_val = split_count(blocks.shape[0], self.val_fraction)
        num_train = blocks.shape[0] - num_val
        check_dataset_size(ids.numel(), self.seq_len, self.batch_size, num_train, num_val, str(self.text_path))
        train_blocks, val_blocks = blocks[:num_train], blocks[num_train:]
        if self.padded:
            generator = torch.Generator().manual_seed(self.seed)
            min_len = max(2, int(self.seq_len * self.min_len_fraction))
            pad_id = self.tokenizer.pad_token_id
            if pad_id is None:
                pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
            self.train_set = padded_samples(train_blocks, pad_id, min_len, generator)
            self.val_set = padded_samples(val_blocks, pad_id, min_len, generator)
        else:
            self.train_set = full_samples(train_blocks)
            self.val_set = full_samples(val_blocks)

    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded), full batches only, so every step sees ``batch_size`` samples."""
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(self.seed),
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        """In text order; the last batch may be smaller."""
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
