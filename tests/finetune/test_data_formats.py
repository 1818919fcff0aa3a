"""Issue 24 item 10: the data module's formats (text and chat files through ``datasets``), the chat
template's response-only loss, packing, and the job on each shipped example; all offline."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from _exact_models import WEIGHT_TOL
from _models import fit, weight_error, weights
from lightning_roundpipe import RoundPipeStrategy, assets
from lightning_roundpipe.finetune import CausalLMFineTune, FineTuneInputError, TextDataModule
from lightning_roundpipe.finetune.data_formats import pack_rows
from test_finetune_job import REPO, compose_job, load_example

TINY = assets.path("tiny-qwen3")
TEMPLATE = str(assets.path("tiny_chat_template.jinja"))
CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Good day"},
    {"role": "user", "content": "Why?"},
    {"role": "assistant", "content": "Because."},
]
# The rendered conversation, tokenized by the tiny tokenizer (58 tokens): "Good day<|endoftext|>" is
# tokens 22-26 and "Because.<|endoftext|>" tokens 50-56; everything else (role headers, user turns,
# the newline after each reply) carries no loss.
ASSISTANT_POSITIONS = [*range(22, 27), *range(50, 57)]
RENDERED_LENGTH = 58


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Every test here runs as a user without network would: datasets may not download anything
    (the flag as the environment sets it, and as datasets read it when imported)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


NO_NETWORK = """
import socket
def refuse(*args, **kwargs):
    raise OSError("network use in an offline test")
socket.socket.connect = socket.create_connection = refuse
from lightning_roundpipe import assets
from lightning_roundpipe.finetune import TextDataModule
for name, kind in (("text_tiny.jsonl", "text"), ("text_tiny.parquet", "text"), ("chat_tiny.jsonl", "chat")):
    data = TextDataModule(assets.path("tiny-qwen3"), text_path=assets.path(name), format=kind,
                          chat_template=str(assets.path("tiny_chat_template.jinja")), seq_len=64, batch_size=4)
    data.setup("fit")
    print(name, len(data.train_set), len(data.val_set))
"""


@pytest.mark.timeout(90)
def test_every_example_loads_in_a_fresh_process_without_network(tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", NO_NETWORK], env=env, capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = {line.split()[0]: tuple(map(int, line.split()[1:])) for line in done.stdout.splitlines()}
    assert sorted(loaded) == ["chat_tiny.jsonl", "text_tiny.jsonl", "text_tiny.parquet"]
    assert all(train >= 4 and val >= 1 for train, val in loaded.values())


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def records_of(name: str) -> list[dict]:
    return [json.loads(line) for line in assets.path(name).read_text().splitlines()]


# ----------------------------------------------------------------------------- each format loads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["text_tiny.jsonl", "text_tiny.parquet"])
def test_text_records_are_joined_by_end_of_text_and_cut_into_blocks(name):
    data = TextDataModule(TINY, text_path=assets.path(name), seq_len=64, batch_size=4)
    data.setup("fit")
    stream = []
    for record in records_of("text_tiny.jsonl"):  # the Parquet file holds the same records
        stream += data.tokenizer(record["text"])["input_ids"] + [data.tokenizer.eos_token_id]
    blocks = len(stream) // 64
    assert (len(data.train_set), len(data.val_set)) == (blocks - round(blocks * 0.1), round(blocks * 0.1))
    rows = torch.cat([data.train_set.input_ids, data.val_set.input_ids])
    assert rows.flatten().tolist() == stream[: blocks * 64]
    assert bool((data.train_set.labels == data.train_set.input_ids).all())
    assert bool((data.train_set.attention_mask == 1).all()) and data.train_set.position_ids is None


@pytest.mark.timeout(60)
def test_a_txt_file_is_one_document_as_before():
    data = TextDataModule(TINY, seq_len=128, batch_size=8)  # the shipped Shakespeare text
    data.setup("fit")
    ids = data.tokenizer(assets.path("shakespeare.txt").read_text(), verbose=False)["input_ids"]
    assert data.val_set.input_ids[-1].tolist() == ids[(len(ids) // 128 - 1) * 128 : len(ids) // 128 * 128]


@pytest.mark.timeout(60)
def test_the_chat_example_loads_with_loss_on_the_replies_only():
    data = TextDataModule(TINY, text_path=assets.path("chat_tiny.jsonl"), format="chat", chat_template=TEMPLATE,
                          seq_len=224, batch_size=4)  # as conf/data/chat_tiny.yaml: no conversation is cut
    data.setup("fit")
    conversations = records_of("chat_tiny.jsonl")
    assert len(data.train_set) + len(data.val_set) == len(conversations) == 128
    rows = [data.train_set[i] for i in range(len(data.train_set))] + [data.val_set[i] for i in range(len(data.val_set))]
    for row, record in zip(rows, conversations):
        ask, reply = (turn["content"] for turn in record["messages"])
        trained = row["labels"][row["labels"] != -100]
        assert data.tokenizer.decode(trained) == reply + "<|endoftext|>"
        rendered = data.tokenizer.decode(row["input_ids"][row["attention_mask"] == 1])
        assert rendered == f"<|user|>\n{ask}\n<|assistant|>\n{reply}<|endoftext|>\n"


# ----------------------------------------------------------------------------- chat: response-only loss


@pytest.mark.timeout(60)
def test_chat_labels_are_exactly_the_assistant_tokens(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 12)
    data = TextDataModule(TINY, text_path=path, format="chat", chat_template=TEMPLATE, seq_len=64, batch_size=4)
    data.setup("fit")
    row = data.train_set[0]
    ids, labels, mask = row["input_ids"], row["labels"], row["attention_mask"]
    # By hand: the tokenizer's offsets of the rendered text say which tokens are the replies.
    text = data.tokenizer.apply_chat_template(CONVERSATION, chat_template=data.chat_template, tokenize=False)
    encoded = data.tokenizer(text, return_offsets_mapping=True)
    replies = [(text.index(s), text.index(s) + len(s)) for s in ("Good day<|endoftext|>", "Because.<|endoftext|>")]
    by_offsets = [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if any(lo <= a and b <= hi for lo, hi in replies)]
    assert by_offsets == ASSISTANT_POSITIONS
    assert ids[:RENDERED_LENGTH].tolist() == encoded["input_ids"]
    expected = torch.full((64,), -100)
    expected[ASSISTANT_POSITIONS] = ids[ASSISTANT_POSITIONS]
    assert labels.tolist() == expected.tolist()
    assert mask.tolist() == [1] * RENDERED_LENGTH + [0] * (64 - RENDERED_LENGTH)
    assert ids[RENDERED_LENGTH:].tolist() == [data.pad_id] * (64 - RENDERED_LENGTH)


@pytest.mark.timeout(60)
def test_instruction_response_records_are_a_user_and_an_assistant_turn(tmp_path):
    pairs = [{"instruction": "Hi there", "response": "Good day"}] * 12
    messages = [{"messages": CONVERSATION[:2]}] * 12
    rows = []
    for name, records in (("pairs.jsonl", pairs), ("messages.jsonl", messages)):
        data = TextDataModule(TINY, text_path=write_jsonl(tmp_path / name, records), format="chat",
                              chat_template=TEMPLATE, seq_len=32, batch_size=4)
        data.setup("fit")
        rows.append(data.train_set[0])
    assert all(torch.equal(rows[0][key], rows[1][key]) for key in rows[0])
    assert (rows[0]["labels"] != -100).nonzero().flatten().tolist() == list(range(22, 27))


@pytest.mark.timeout(60)
def test_a_template_without_generation_blocks_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 12)
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    data = TextDataModule(TINY, text_path=path, format="chat", chat_template=plain, seq_len=64, batch_size=4)
    with pytest.raises(FineTuneInputError) as refused:
        data.setup("fit")
    assert str(refused.value).startswith(
        "data.format=chat: the chat template marks no assistant tokens, so there is nothing to train on.")
    assert data.train_set is None


def test_bad_data_options_name_their_key(tmp_path):
    with pytest.raises(FineTuneInputError, match=r"^data.format='csv' is not a data format; use one of \['text', 'chat'\]"):
        TextDataModule(TINY, format="csv")
    with pytest.raises(FineTuneInputError, match=r"^data.padded=true makes random-length text samples"):
        TextDataModule(TINY, padded=True, packing=True)
    data = TextDataModule(TINY, text_path=assets.path("text_tiny.jsonl"), text_field="body")
    with pytest.raises(FineTuneInputError, match=r"^data.text_field='body' is not a field of .*text_tiny.jsonl"):
        data.setup("fit")
    data = TextDataModule(TINY, text_path=assets.path("chat_tiny.jsonl"), format="chat")  # no chat_template
    with pytest.raises(FineTuneInputError, match=r"^data.format=chat: the tokenizer has no chat template; set data.chat_template"):
        data.setup("fit")
    csv = tmp_path / "data.csv"
    csv.write_text("text\nhello\n")
    with pytest.raises(FineTuneInputError, match=r"unknown file type '.csv'"):
        TextDataModule(TINY, text_path=csv).setup("fit")


# ----------------------------------------------------------------------------- packing


def test_packing_restarts_positions_and_masks_each_samples_first_label():
    import datasets

    samples = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]],
                                          "labels": [[1, 2, 3], [-100, 5], [6, 7, -100, 9]]})
    rows = pack_rows(samples, seq_len=4)
    assert rows["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # the tail [9] is dropped
    assert rows["position_ids"] == [[0, 1, 2, 0], [1, 0, 1, 2]]  # the second sample continues in row 2
    assert rows["labels"] == [[-100, 2, 3, -100], [5, -100, 7, -100]]
    assert "attention_mask" not in rows.column_names


@pytest.mark.timeout(60)
def test_packed_chat_rows_are_the_conversations_back_to_back(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 24)
    data = TextDataModule(TINY, text_path=path, format="chat", chat_template=TEMPLATE, seq_len=64, batch_size=4,
                          packing=True)
    data.setup("fit")
    assert len(data.train_set) + len(data.val_set) == 24 * RENDERED_LENGTH // 64
    row = data.train_set[0]
    assert row["position_ids"].tolist() == list(range(RENDERED_LENGTH)) + list(range(64 - RENDERED_LENGTH))
    assert (row["labels"] != -100).nonzero().flatten().tolist() == ASSISTANT_POSITIONS  # the second starts unlabelled
    assert "attention_mask" not in row


@pytest.mark.timeout(60)
def test_a_packed_row_computes_what_its_samples_compute_apart():
    """What HF computes for a packed row: with use_cache=False (what the module passes for packed
    batches) a block-diagonal mask, so the loss is the samples' own; with a cache, a plain causal
    mask that attends across them."""
    data = TextDataModule(TINY, text_path=assets.path("text_tiny.jsonl"), seq_len=64, batch_size=4, packing=True)
    data.setup("fit")
    module = CausalLMFineTune(TINY)
    row = {key: value[:1] for key, value in next(iter(data.train_dataloader())).items()}
    # a row may begin inside a sample (its positions continuing from the row before)
    starts = sorted({0, *(row["position_ids"][0] == 0).nonzero().flatten().tolist()}) + [64]
    assert len(starts) >= 3  # at least two samples meet in this row
    total, count = 0.0, 0
    with torch.no_grad():
        for a, b in zip(starts, starts[1:]):
            ids = row["input_ids"][:, a:b]
            labels = row["labels"][:, a:b].clone()
            piece = module.model(input_ids=ids, position_ids=row["position_ids"][:, a:b], labels=labels)
            n = int((labels[:, 1:] != -100).sum())
            total, count = total + piece.loss.item() * n, count + n
        packed = module(row).loss.item()
        leaky = module.model(input_ids=row["input_ids"], position_ids=row["position_ids"], labels=row["labels"]).loss
    assert packed == pytest.approx(total / count, rel=1e-5)
    assert abs(leaky.item() - packed) > 1e-3


class SGDFineTune(CausalLMFineTune):
    """The job's module with plain SGD, as the exactness tests compare."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.timeout(120)
def test_packed_training_under_roundpipe_matches_the_default_strategy():
    data = TextDataModule(TINY, text_path=assets.path("chat_tiny.jsonl"), format="chat", chat_template=TEMPLATE,
                          seq_len=64, batch_size=4, packing=True)
    data.setup("fit")
    torch.manual_seed(0)
    reference = SGDFineTune(TINY)
    start = weights(reference)
    fit(reference, "auto", max_steps=3, batch_size=4, data=data.train_set, record_grads=False)
    piped = SGDFineTune(TINY)
    fit(piped, RoundPipeStrategy(microbatches=2), devices=2, max_steps=3, batch_size=4, data=data.train_set,
        record_grads=False)
    assert weight_error(weights(piped), weights(reference), start) <= WEIGHT_TOL


# ----------------------------------------------------------------------------- the job on each format


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides", [
    ("data=chat_tiny",),
    ("data=chat_tiny", "data.packing=true", "strategy=default"),
    ("data=text_tiny", "strategy=default"),
    ("data=text_tiny", f"data.text_path={assets.path('text_tiny.parquet')}", "data.packing=false", "strategy=default"),
], ids=["chat", "chat-packed", "text-jsonl-packed", "text-parquet"])
def test_the_job_trains_two_steps_on_each_format(tmp_path, overrides):
    cfg = compose_job(*overrides, "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=2",
                      f"out_dir={tmp_path}")
    results = load_example().main(cfg)
    assert results["steps"] == 2 and math.isfinite(results["train_loss"])
    assert results["val_ppl_after"] < results["val_ppl_before"]
    assert (tmp_path / "last.ckpt").is_file()
