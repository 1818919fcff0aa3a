"""What the code outside a block stack costs when it runs on the host (the block-stack path).

A nanoGPT-style model (tied head) is timed three ways in one process, interleaved, on the CPU
backend: the outside code alone (embedding, final norm, head and loss, forward and backward, with
the blocks replaced by identities), the block-stack path (blocks pipelined, the rest on the host
thread), and a declared chain (``roundpipe_layers()``: embedding and head as the first and last
pipeline layers, only the loss on the host). Ratios, not absolute times, are the result.

    PYTHONPATH=src python benchmarks/figures/block_stack_host_cost.py --vocab 8192 --dim 128 --layers 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe.runtime import RoundPipeRuntime, RuntimeOptions


class Block(nn.Module):
    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln_1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln_2(x))


class Embed(nn.Module):
    def __init__(self, vocab, seq, dim):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)

    def forward(self, idx):
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, embed: Embed, dim):
        super().__init__()
        self.ln_f, self.embed = nn.LayerNorm(dim), embed

    def forward(self, x):
        return F.linear(self.ln_f(x), self.embed.wte.weight)  # tied to the token embedding


class GPT(nn.Module):
    def __init__(self, vocab, seq, dim, layers, declared=False):
        super().__init__()
        self.embed = Embed(vocab, seq, dim)
        self.h = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = Head(self.embed, dim)
        self.declared = declared
        for m in self.modules():  # nanoGPT's init; N(0, 1) embeddings give logits whose softmax is denormal
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


class DeclaredGPT(GPT):
    def forward(self, idx):  # what roundpipe_layers() states
        return super().forward(idx)

    def roundpipe_layers(self):
        return [self.embed, *self.h, self.head]


def step(model, idx, targets):
    logits = model(idx)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    model.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    targets = torch.randint(0, args.vocab, (args.batch, args.seq))

    outside = GPT(args.vocab, args.seq, args.dim, args.layers)
    outside.h = nn.ModuleList(nn.Identity() for _ in range(args.layers))
    stack = GPT(args.vocab, args.seq, args.dim, args.layers)
    declared = DeclaredGPT(args.vocab, args.seq, args.dim, args.layers)
    declared.load_state_dict(stack.state_dict())
    opts = RuntimeOptions(microbatches=args.microbatches, step_metrics=False)
    runtimes = [RoundPipeRuntime.attach(stack, "cpu", args.workers, opts),
                RoundPipeRuntime.attach(declared, "cpu", args.workers, opts)]
    runs = {"outside code alone (host)": outside, "block stack (outside code on host)": stack,
            "declared chain (embedding, head on workers)": declared}
    times: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for name, model in runs.items():
            step(model, idx, targets)  # warm-up
        for _ in range(args.repeats):
            for name, model in runs.items():
                t0 = time.perf_counter()
                step(model, idx, targets)
                times[name].append(time.perf_counter() - t0)
    finally:
        for rt in runtimes:
            rt.detach()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med["block stack (outside code on host)"]
    print(f"vocab {args.vocab}, dim {args.dim}, {args.layers} blocks, batch {args.batch} x seq {args.seq}, "
          f"{args.workers} CPU workers, {args.microbatches} microbatches (median of {args.repeats})")
    print("| run | step s | vs block-stack step |\n|---|---|---|")
    for name, t in med.items():
        print(f"| {name} | {t:.3f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
