"""Local data files turned into causal-LM rows with ``datasets``: load, tokenize, group or pack.

Every step is a ``datasets`` ``load_dataset`` or ``map`` (batched where it can be), so nothing
here is a hand-written loop over the corpus, and nothing is downloaded: the ``json``,
``parquet`` and ``text`` builders ship with the package.

Rows carry ``input_ids`` and ``labels`` (``-100`` where no loss is wanted; the model shifts
labels itself), plus ``attention_mask`` (padded rows) or ``position_ids`` (packed rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import datasets

from .checks import FineTuneInputError

IGNORE_INDEX = -100  # label value that Hugging Face losses skip
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """No ``datasets`` progress bars inside (the job prints its own progress); restored after."""
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.utils.enable_progress_bars()


def load_records(path: Path) -> datasets.Dataset:
    """The records of a local ``.json``/``.jsonl``/``.parquet`` file, or a ``.txt`` file as one
    record ``{"text": whole file}`` (one document)."""
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise FineTuneInputError(
            f"data.text_path {str(path)!r}: unknown file type {path.suffix!r}; use one of {sorted(BUILDERS)}."
        )
    extra = {"sample_by": "document"} if builder == "text" else {}
    with quiet_progress():
        return datasets.load_dataset(builder, data_files=str(path), split="train", **extra)


def require_column(records: datasets.Dataset, field: str, key: str, path: Path) -> None:
    """Refuse, naming the config key, a records file without the field ``key`` names."""
    if field not in records.column_names:
        raise FineTuneInputError(
            f"data.{key}={field!r} is not a field of {str(path)!r} (its fields: {records.column_names}); "
            f"set data.{key} to the field that holds it."
        )


def tokenize_text(records: datasets.Dataset, tokenizer, field: str, eos_between: bool) -> datasets.Dataset:
    """``input_ids`` = ``labels`` = the tokens of ``field``; with ``eos_between`` each record ends
    with the end-of-text token, so grouped documents stay apart."""
    eos = [tokenizer.eos_token_id] if eos_between and tokenizer.eos_token_id is not None else []

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        ids = [row + eos for row in tokenizer(batch[field], verbose=False)["input_ids"]]
        return {"input_ids": ids, "labels": [list(row) for row in ids]}

    with quiet_progress():
        return records.map(tokenize, batched=True, remove_columns=records.column_names)


def conversation(record: dict[str, Any], messages_field: str, instruction_field: str, response_field: str) -> list:
    """The record's chat messages: its ``messages_field`` list, or a user turn from
    ``instruction_field`` and an assistant turn from ``response_field``."""
    if messages_field in record:
        return record[messages_field]
    return [
        {"role": "user", "content": record[instruction_field]},
        {"role": "assistant", "content": record[response_field]},
    ]


def render_chat(
    records: datasets.Dataset,
    tokenizer,
    template: str | None,
    messages_field: str,
    instruction_field: str,
    response_field: str,
) -> datasets.Dataset:
    """Each conversation through the chat template; ``labels`` keep the assistant tokens only.

    The assistant tokens are those the template marks with ``{% generation %}`` blocks
    (``return_assistant_tokens_mask``); a template without them marks none, which is refused.
    """
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise FineTuneInputError(
            "data.format=chat: the tokenizer has no chat template; set data.chat_template to a .jinja file "
            "(for the shipped tiny tokenizers: ${asset:tiny_chat_template.jinja}, as conf/data/chat_tiny.yaml does)."
        )

    def render(record: dict[str, Any]) -> dict[str, list]:
        messages = conversation(record, messages_field, instruction_field, response_field)
        out = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, assistant = list(out["input_ids"]), list(out["assistant_masks"])
        return {"input_ids": ids, "labels": [t if keep else IGNORE_INDEX for t, keep in zip(ids, assistant)]}

    with quiet_progress():
        rendered = records.map(render, remove_columns=records.column_names)
    if len(rendered) and not any(label != IGNORE_INDEX for row in rendered["labels"] for label in row):
        raise FineTuneInputError(
            "data.format=chat: the chat template marks no assistant tokens, so there is nothing to train on. "
            "Its assistant replies need {% generation %}...{% endgeneration %} blocks; set data.chat_template to "
            "a template that has them (the shipped one: ${asset:tiny_chat_template.jinja})."
        )
    return rendered


def group_blocks(tokens: datasets.Dataset, seq_len: int) -> datasets.Dataset:
    """The token stream cut into ``seq_len`` blocks (per ``map`` batch; its tail is dropped):
    every token attended to, ``labels`` as tokenized."""

    def group(batch: dict[str, list]) -> dict[str, list]:
        ids, labels = list(chain.from_iterable(batch["input_ids"])), list(chain.from_iterable(batch["labels"]))
        cuts = range(0, len(ids) // seq_len * seq_len, seq_len)
        return {
            "input_ids": [ids[i : i + seq_len] for i in cuts],
            "attention_mask": [[1] * seq_len for _ in cuts],
            "labels": [labels[i : i + seq_len] for i in cuts],
        }

    with quiet_progress():
        return tokens.map(group, batched=True, remove_columns=tokens.column_names)


def pack_rows(tokens: datasets.Dataset, seq_len: int) -> datasets.Dataset:
    """Samples concatenated into full ``seq_len`` rows, as Hugging Face's
    ``DataCollatorWithFlattening`` packs them: ``position_ids`` restart at 0 for each sample and
    each sample's first label is ``-100`` (nothing predicts it across the boundary); no
    ``attention_mask``, so the model finds the samples from ``position_ids``. A sample that
    does not fit in a row's end continues in the next row (its positions continuing); the
    last incomplete row is dropped."""

    def pack(batch: dict[str, list]) -> dict[str, list]:
        ids = list(chain.from_iterable(batch["input_ids"]))
        labels = list(chain.from_iterable([IGNORE_INDEX] + row[1:] for row in batch["labels"]))
        positions = list(chain.from_iterable(range(len(row)) for row in batch["input_ids"]))
        cuts = range(0, len(ids) // seq_len * seq_len, seq_len)
        return {
            "input_ids": [ids[i : i + seq_len] for i in cuts],
            "position_ids": [positions[i : i + seq_len] for i in cuts],
            "labels": [labels[i : i + seq_len] for i in cuts],
        }

    with quiet_progress():
        return tokens.map(pack, batched=True, remove_columns=tokens.column_names)


def pad_rows(tokens: datasets.Dataset, seq_len: int, pad_id: int) -> datasets.Dataset:
    """One row per sample, cut to ``seq_len`` and right-padded (``attention_mask`` 0, ``labels``
    -100 on the padding)."""

    def pad(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            ids, labels = ids[:seq_len], labels[:seq_len]
            fill = seq_len - len(ids)
            out["input_ids"].append(ids + [pad_id] * fill)
            out["attention_mask"].append([1] * len(ids) + [0] * fill)
            out["labels"].append(labels + [IGNORE_INDEX] * fill)
        return out

    with quiet_progress():
        return tokens.map(pad, batched=True, remove_columns=tokens.column_names)
