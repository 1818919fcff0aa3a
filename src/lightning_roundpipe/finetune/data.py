"""A local data file as a causal-LM data module: loaded and tokenized once with ``datasets``,
made into ``seq_len`` rows, split train/val.

Reads ``.txt``, ``.json``/``.jsonl`` or ``.parquet`` with no download, in two formats: ``text``
(records joined and cut into ``seq_len``-token blocks, every token predicted) and ``chat`` (each
conversation through the tokenizer's chat template, loss only on assistant tokens).
``packing=True`` concatenates samples with restarting ``position_ids``; the last
``val_fraction`` of the rows is validation. The formats and options in full: docs/design.md,
design notes, ``finetune/data.py``; the user's view: docs/finetune.md.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoTokenizer

from .. import assets
from . import data_formats
from .checks import FineTuneInputError, check_dataset_size, check_model_path, check_seq_len, check_tokenizer_fits
from .data_formats import IGNORE_INDEX

FORMATS = ("text", "chat")


class BlockDataset(Dataset):
    """Rows of equally shaped tensors, served as dicts: ``input_ids``, ``labels`` and whichever
    of ``attention_mask`` (padded rows) and ``position_ids`` (packed rows) is given."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ):
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.labels = labels
        self.position_ids = position_ids

    @classmethod
    def from_rows(cls, rows, seq_len: int) -> "BlockDataset":
        """A ``datasets.Dataset`` of ``seq_len``-long rows as tensors (its missing columns ``None``)."""
        columns = {name: torch.tensor(rows[name], dtype=torch.long).reshape(len(rows), seq_len) for name in rows.column_names}
        return cls(columns["input_ids"], columns.get("attention_mask"), columns["labels"], columns.get("position_ids"))

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = {"input_ids": self.input_ids[index], "labels": self.labels[index]}
        for name in ("attention_mask", "position_ids"):
            value = getattr(self, name)
            if value is not None:
                row[name] = value[index]
        return row

    def slice(self, start: int, stop: int) -> "BlockDataset":
        """Rows ``start`` to ``stop`` (exclusive)."""
        pick = lambda value: None if value is None else value[start:stop]  # noqa: E731
        return BlockDataset(pick(self.input_ids), pick(self.attention_mask), pick(self.labels), pick(self.position_ids))


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


def chat_template_text(chat_template: str | Path | None) -> str | None:
    """``chat_template`` as template text: a ``.jinja`` file's contents, a string as is, or ``None``
    (the tokenizer's own)."""
    if chat_template is None:
        return None
    if str(chat_template).endswith(".jinja"):
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise FineTuneInputError(f"data.chat_template {str(path)!r} is not a file; point it at a Jinja template.")
        return path.read_text(encoding="utf-8")
    return str(chat_template)


class TextDataModule(pl.LightningDataModule):
    """Causal-LM batches from a local text, JSON(L) or Parquet file, tokenized with the model's tokenizer.

    Args:
        model_path: the Hugging Face model directory whose tokenizer and limits apply.
        text_path: the data file (``.txt``, ``.json``, ``.jsonl`` or ``.parquet``); ``None`` = the
            shipped Shakespeare excerpt.
        tokenizer: a tokenizer directory to use instead of the model's own (``None`` = ``model_path``).
        seq_len: tokens per sample; at most the model's ``max_position_embeddings``.
        batch_size: samples per batch (training batches are always full).
        val_fraction: share of the rows, taken from the end, used for validation.
        padded: (text format, unpacked) make variable-length samples, right-padded (attention_mask 0, labels -100).
        min_len_fraction: with ``padded``, the shortest sample as a fraction of ``seq_len``.
        seed: seeds the shuffling and the padded lengths.
        num_workers: DataLoader worker processes.
        format: ``"text"`` (every token predicted) or ``"chat"`` (chat template, loss on the
            assistant tokens only).
        text_field: with ``format="text"``, the record field holding the text (a ``.txt`` file's is ``text``).
        messages_field: with ``format="chat"``, the field holding a list of ``{role, content}``.
        instruction_field: with ``format="chat"`` and no ``messages_field``, the user turn's field.
        response_field: with ``format="chat"`` and no ``messages_field``, the assistant turn's field.
        chat_template: a Jinja template (a ``.jinja`` file or the text) used instead of the
            tokenizer's own; its assistant replies must sit in ``{% generation %}`` blocks.
        packing: concatenate samples into full ``seq_len`` rows with ``position_ids`` restarting
            per sample (no padding, no cross-sample attention with ``use_cache=False``).

    Bad input (missing model, tokenizer larger than the embedding, ``seq_len`` beyond the
    model's positions, unknown format, data too short for one batch) raises
    ``FineTuneInputError``: the option checks on construction, the data checks in ``setup``,
    both before training starts.
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
        format: str = "text",
        text_field: str = "text",
        messages_field: str = "messages",
        instruction_field: str = "instruction",
        response_field: str = "response",
        chat_template: str | Path | None = None,
        packing: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model_path = check_model_path(model_path)
        self.text_path = Path(text_path).expanduser() if text_path is not None else assets.path("shakespeare.txt")
        if not self.text_path.is_file():
            raise FineTuneInputError(f"data.text_path {str(self.text_path)!r} is not a file; point it at a data file.")
        if not 0.0 <= val_fraction < 1.0:
            raise FineTuneInputError(f"data.val_fraction={val_fraction} must be in [0, 1).")
        if format not in FORMATS:
            raise FineTuneInputError(f"data.format={format!r} is not a data format; use one of {list(FORMATS)}.")
        if padded and (packing or format == "chat"):
            raise FineTuneInputError(
                "data.padded=true makes random-length text samples; it applies to data.format=text without "
                "data.packing (chat rows are padded already, packed rows have no padding). Drop data.padded."
            )
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
        self.format = format
        self.fields = {"text_field": text_field, "messages_field": messages_field,
                       "instruction_field": instruction_field, "response_field": response_field}
        self.chat_template = chat_template_text(chat_template)
        self.packing = packing
        self.train_set: BlockDataset | None = None
        self.val_set: BlockDataset | None = None

    @property
    def pad_id(self) -> int:
        """The padding token: the tokenizer's, else its end-of-text token, else 0."""
        for candidate in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if candidate is not None:
                return candidate
        return 0

    def tokenized(self):
        """The file's records as token samples (``input_ids``, ``labels``), one per record."""
        records = data_formats.load_records(self.text_path)
        if self.format == "text":
            data_formats.require_column(records, self.fields["text_field"], "text_field", self.text_path)
            eos_between = self.text_path.suffix.lower() != ".txt"  # a .txt file is one document
            return data_formats.tokenize_text(records, self.tokenizer, self.fields["text_field"], eos_between)
        if self.fields["messages_field"] not in records.column_names:
            for key in ("instruction_field", "response_field"):
                data_formats.require_column(records, self.fields[key], key, self.text_path)
        return data_formats.render_chat(records, self.tokenizer, self.chat_template, **{
            key: self.fields[key] for key in ("messages_field", "instruction_field", "response_field")})

    def rows(self, tokens):
        """The token samples as ``seq_len`` rows: packed, grouped (text) or padded (chat)."""
        if self.packing:
            return data_formats.pack_rows(tokens, self.seq_len)
        if self.format == "text":
            return data_formats.group_blocks(tokens, self.seq_len)
        return data_formats.pad_rows(tokens, self.seq_len, self.pad_id)

    def setup(self, stage: str | None = None) -> None:
        """Tokenize and split once; later calls (Lightning calls it per stage) reuse the result."""
        if self.train_set is not None:
            return
        tokens = self.tokenized()
        rows = BlockDataset.from_rows(self.rows(tokens), self.seq_len)
        num_val = split_count(len(rows), self.val_fraction)
        num_train = len(rows) - num_val
        token_count = sum(len(sample) for sample in tokens["input_ids"])
        check_dataset_size(token_count, self.seq_len, self.batch_size, num_train, num_val, str(self.text_path))
        self.train_set, self.val_set = rows.slice(0, num_train), rows.slice(num_train, len(rows))
        if self.padded:
            generator = torch.Generator().manual_seed(self.seed)
            min_len = max(2, int(self.seq_len * self.min_len_fraction))
            self.train_set = padded_samples(self.train_set.input_ids, self.pad_id, min_len, generator)
            self.val_set = padded_samples(self.val_set.input_ids, self.pad_id, min_len, generator)

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
