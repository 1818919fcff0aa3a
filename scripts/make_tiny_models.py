"""Make the tiny pretrained models shipped in ``src/lightning_roundpipe/assets/``.

Steps, all on the CPU and seeded, so a rerun gives the same files:

1. train a byte-level BPE tokenizer (512 tokens, ``<|endoftext|>`` as end-of-text and padding)
   on the shipped Shakespeare text, wrapped as a ``transformers`` fast tokenizer;
2. build a tiny Qwen3 (4 layers, hidden 64, 4 heads, 2 key/value heads) and pretrain it with a
   plain PyTorch loop on the first 90% of the text, so the checkpoint is a real (if small)
   language model;
3. do the same for a tiny Llama of the same shape, with fewer steps;
4. save each with ``save_pretrained`` (safetensors) next to a copy of the tokenizer.

Two choices make the checkpoints useful for fine-tuning demos and tests, where validation
perplexity should fall within a few steps:

- the last 10% of the text is held out, so the fine-tuning job's validation split (the last
  10% of its blocks) is text the model has never seen and its perplexity measures
  generalization, not memory;
- pretraining stops at a constant learning rate, early (a few epochs, before held-out loss
  turns up), like an intermediate checkpoint: fine-tuning at a lower rate then lowers
  held-out loss at once. A checkpoint annealed to convergence would first get worse under a
  fresh optimizer.

Run from the repository root: ``python scripts/make_tiny_models.py`` (under a minute on two
cores). The models exist for tests and smoke runs: a fine-tuning job needs a model that already
knows something, so its loss curve means something, and that fits in a few megabytes.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

ASSETS = Path(__file__).resolve().parents[1] / "src" / "lightning_roundpipe" / "assets"
TEXT = ASSETS / "data" / "shakespeare.txt"
EOS = "<|endoftext|>"
VOCAB_SIZE = 512
MAX_POSITIONS = 512


@dataclass
class PretrainOptions:
    """How long and how hard to pretrain one tiny model."""

    steps: int
    seq_len: int = 128
    batch_size: int = 16
    lr: float = 3e-3  # constant after warmup (see the module docstring)
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 0


def train_tokenizer(text: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``VOCAB_SIZE`` tokens trained on ``text``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknowns
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=MAX_POSITIONS,
    )


def common_shape(tokenizer: PreTrainedTokenizerFast) -> dict:
    """The shape both tiny models share."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def pretrain(model: torch.nn.Module, ids: torch.Tensor, options: PretrainOptions, name: str) -> tuple[float, float]:
    """Next-token training on random windows of ``ids``; returns (first, last) mean loss of 20 steps."""
    generator = torch.Generator().manual_seed(options.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": options.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=options.lr,
        betas=(0.9, 0.95),
    )

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / options.warmup_steps)
    )
    model.train()
    losses = []
    started = time.perf_counter()
    for step in range(options.steps):
        starts = torch.randint(0, len(ids) - options.seq_len, (options.batch_size,), generator=generator)
        batch = torch.stack([ids[s : s + options.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == options.steps - 1:
            print(f"  {name} step {step:4d} loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)")
    model.eval()
    window = min(20, len(losses))
    return sum(losses[:window]) / window, sum(losses[-window:]) / window


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, ids: torch.Tensor, seq_len: int) -> float:
    """Mean next-token loss over consecutive ``seq_len`` blocks of ``ids``."""
    blocks = ids[: ids.numel() // seq_len * seq_len].reshape(-1, seq_len)
    return model(input_ids=blocks, labels=blocks).loss.item()


def make_model(
    name: str, model: torch.nn.Module, tokenizer, ids: torch.Tensor, held_out: torch.Tensor, options: PretrainOptions
) -> None:
    """Pretrain ``model`` on ``ids`` and save it with the tokenizer under ``ASSETS / name``."""
    params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {params:,} parameters, {options.steps} steps")
    first, last = pretrain(model, ids, options, name)
    print(f"{name}: training loss {first:.3f} -> {last:.3f}, held-out loss {held_out_loss(model, held_out, options.seq_len):.3f}")
    if not last < first - 1.0:
        raise RuntimeError(f"{name} did not learn (loss {first:.3f} -> {last:.3f})")
    out = ASSETS / name
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    portable_tokenizer_config(out / "tokenizer_config.json")
    print(f"{name}: saved to {out}")


def portable_tokenizer_config(config_path: Path) -> None:
    """Name the generic fast-tokenizer class, which every transformers version resolves.

    transformers 5 writes its new backend class name, which 4.x cannot load; the two read the
    same ``tokenizer.json``.
    """
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qwen3-steps", type=int, default=400, help="pretraining steps of tiny-qwen3")
    parser.add_argument("--llama-steps", type=int, default=200, help="pretraining steps of tiny-llama")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    text = TEXT.read_text(encoding="utf-8")
    tokenizer = train_tokenizer(text)
    ids = torch.tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.long)
    # Hold out the last 10% of the tokens, cut at a 128-token block boundary: it covers the
    # validation split of the fine-tuning data module (last 10% of its blocks).
    boundary = int(0.9 * len(ids)) // 128 * 128
    train_ids, held_out = ids[:boundary], ids[boundary:]
    print(
        f"tokenizer: {len(tokenizer)} tokens; text: {len(text):,} chars -> {len(ids):,} tokens, "
        f"{len(train_ids):,} for pretraining, {len(held_out):,} held out"
    )

    shape = common_shape(tokenizer)
    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**shape))
    make_model("tiny-qwen3", qwen3, tokenizer, train_ids, held_out, PretrainOptions(steps=args.qwen3_steps, seed=1))
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**shape))
    make_model("tiny-llama", llama, tokenizer, train_ids, held_out, PretrainOptions(steps=args.llama_steps, seed=2))


if __name__ == "__main__":
    main()
