"""Make the tiny example data sets shipped in ``src/lightning_roundpipe/assets/data/``.

From the shipped Shakespeare excerpt (``assets/data/shakespeare.txt``), deterministically:

- ``text_tiny.jsonl`` and ``text_tiny.parquet``: the same 160 speeches as records ``{"text": ...}``
  (the ``format: text`` example, in both file types the data module reads);
- ``chat_tiny.jsonl``: 128 two-turn conversations ``{"messages": [{"role": "user", ...},
  {"role": "assistant", ...}]}``, each a speech and the speech that answers it (the
  ``format: chat`` example).

Speeches are taken from the start of the text, short ones only. Both sets are big enough for the
default job's 40 steps of 4 samples to stay within two epochs. Run from the repository root: ``python scripts/make_tiny_data.py`` (seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA = Path(__file__).resolve().parents[1] / "src" / "lightning_roundpipe" / "assets" / "data"
TEXT_RECORDS = 160
CHAT_RECORDS = 128
MAX_SPEECH_CHARS = 240  # keeps each file a few KB and each conversation within 128 tokens or so


def speeches(text: str) -> list[str]:
    """The speeches ("NAME:\\nlines") of the text, in order; short ones only."""
    blocks = [block.strip() for block in text.split("\n\n")]
    return [block for block in blocks if ":\n" in block and len(block) <= MAX_SPEECH_CHARS]


def body(speech: str) -> str:
    """A speech without its speaker line."""
    return speech.split(":\n", 1)[1]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")


def main() -> None:
    found = speeches((DATA / "shakespeare.txt").read_text(encoding="utf-8"))
    texts = [{"text": speech} for speech in found[:TEXT_RECORDS]]
    write_jsonl(DATA / "text_tiny.jsonl", texts)
    pq.write_table(pa.Table.from_pylist(texts), DATA / "text_tiny.parquet")
    pairs = zip(found[0 : 2 * CHAT_RECORDS : 2], found[1 : 2 * CHAT_RECORDS : 2])
    chats = [
        {"messages": [{"role": "user", "content": body(ask)}, {"role": "assistant", "content": body(answer)}]}
        for ask, answer in pairs
    ]
    write_jsonl(DATA / "chat_tiny.jsonl", chats)
    for name in ("text_tiny.jsonl", "text_tiny.parquet", "chat_tiny.jsonl"):
        print(f"{DATA / name}: {(DATA / name).stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
