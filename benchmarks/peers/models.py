"""The benchmark model: a decoder-style stack of MLP blocks with a heavy LM head, and its costs.

Every system in ``cpu_peers.py`` trains the very same modules (same seed, same shapes):

- :class:`Block`: pre-LayerNorm, ``Linear(H, 4H)``, GELU, ``Linear(4H, H)``, residual. Forward
  matmul FLOPs per token: ``2 * (H * 4H) * 2 = 16 H^2`` (attention is left out on purpose: the
  point is the cost *ratio* of head to block, and an MLP block keeps the CPU run short).
- :class:`LMHead`: LayerNorm and ``Linear(H, V)`` (no bias, like real LM heads); forward FLOPs per
  token ``2 H V``. The head costs ``V / (8 H)`` blocks, so ``vocab = head_ratio * 8 * H`` gives a
  head as heavy as ``head_ratio`` blocks (a 150k-vocabulary model's head costs 2-5 blocks).

The input is a float tensor ``(batch, seq, H)`` standing for embedded tokens (an embedding
lookup costs no FLOPs worth measuring), the target a ``(batch, seq)`` tensor of token ids; the
loss is the mean cross-entropy over all tokens.

Adapters give each system the form it expects: :class:`CarryBlock` / :class:`LossHead` for the
RoundPipe engine (a dict carry ``{"h", "y"}`` and a per-microbatch ``loss_sum`` for the fused last
stage), :class:`StageModule` for torch.distributed.pipelining and the plain loop.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class ShapeConfig:
    """One benchmark shape: model size, head weight and batch.

    name: label used in tables and JSON.
    hidden: width H of the residual stream (the MLP is 4H wide).
    blocks: number of decoder blocks (the head comes after them).
    head_ratio: forward FLOPs of the head divided by those of one block (sets the vocabulary).
    seq_len / batch: tokens per sample and samples per global batch.
    microbatches: microbatches per step (every pipelined system uses the same number).
    """

    name: str
    hidden: int = 384
    blocks: int = 6
    head_ratio: float = 3.0
    seq_len: int = 128
    batch: int = 8
    microbatches: int = 4

    @property
    def vocab(self) -> int:
        """Vocabulary size giving the head ``head_ratio`` blocks' FLOPs, rounded to a multiple of 64."""
        return max(64, int(round(self.head_ratio * 8 * self.hidden / 64.0)) * 64)

    @property
    def tokens(self) -> int:
        """Tokens per global batch (what tokens/s counts)."""
        return self.batch * self.seq_len

    @property
    def num_layers(self) -> int:
        """Pipelined layers: the blocks plus the head."""
        return self.blocks + 1

    def as_dict(self) -> dict:
        return {**asdict(self), "vocab": self.vocab, "tokens": self.tokens}


# ------------------------------------------------------------------------------ FLOPs
def block_flops_per_token(shape: ShapeConfig) -> int:
    """Forward matmul FLOPs of one block per token (16 H^2)."""
    h = shape.hidden
    return 2 * (h * 4 * h) * 2


def head_flops_per_token(shape: ShapeConfig) -> int:
    """Forward matmul FLOPs of the LM head per token (2 H V)."""
    return 2 * shape.hidden * shape.vocab


def head_to_block_flops(shape: ShapeConfig) -> float:
    """How many blocks the head weighs, by forward FLOPs."""
    return head_flops_per_token(shape) / block_flops_per_token(shape)


# ------------------------------------------------------------------------------ modules
class Block(nn.Module):
    """Pre-norm MLP decoder block with a residual connection."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class LMHead(nn.Module):
    """Final norm and the vocabulary projection; returns logits."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(h))


def token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over every token of ``(batch, seq, V)`` logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)


def build_layers(shape: ShapeConfig, seed: int = 0) -> tuple[list[Block], LMHead]:
    """The blocks and the head, initialised from ``seed`` (identical for every system)."""
    torch.manual_seed(seed)
    blocks = [Block(shape.hidden) for _ in range(shape.blocks)]
    head = LMHead(shape.hidden, shape.vocab)
    return blocks, head


def make_batch(shape: ShapeConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A random global batch: inputs ``(batch, seq, H)`` and target ids ``(batch, seq)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.batch, shape.seq_len, shape.hidden, generator=g)
    y = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len), generator=g)
    return x, y


# --------------------------------------------------------------- adapters per system
class CarryBlock(nn.Module):
    """A block for the RoundPipe engine: the carry is ``{"h": hidden, "y": targets}``."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, carry: dict) -> dict:
        return {"h": self.block(carry["h"]), "y": carry["y"]}


class LossHead(nn.Module):
    """The head for the RoundPipe engine's fused last stage: returns the microbatch's summed loss."""

    def __init__(self, head: LMHead):
        super().__init__()
        self.head = head

    def forward(self, carry: dict) -> dict:
        return {"loss_sum": token_loss(self.head(carry["h"]), carry["y"], reduction="sum")}


def roundpipe_sequential(blocks: list[Block], head: LMHead) -> nn.Sequential:
    """The model as the nn.Sequential the RoundPipe runtime pipelines (one layer per block, head last)."""
    return nn.Sequential(*[CarryBlock(b) for b in blocks], LossHead(head))


class StageModule(nn.Module):
    """A run of blocks (and optionally the head) as one module: a pipeline stage or the whole model.

    ``recompute`` wraps each block in ``torch.utils.checkpoint`` (the head is not checkpointed,
    as in common practice and as in RoundPipe's fused last stage, which never recomputes it).
    """

    def __init__(self, blocks: list[Block], head: LMHead | None = None, recompute: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.recompute = recompute

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.recompute and torch.is_grad_enabled():
                h = checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.head(h) if self.head is not None else h


# ------------------------------------------------------------------- measured costs
@dataclass
class LayerTiming:
    """Measured seconds of one layer on one microbatch, one thread.

    checkpointed_s: the block under ``torch.utils.checkpoint`` (non-reentrant), as torch's pipeline
    schedules run it with recompute on: its forward, then its backward with the recompute. Not
    ``2 f + b``: torch's non-reentrant checkpoint stops recomputing once it has every tensor the
    backward saved (``set_checkpoint_early_stop``, on by default), so a block's last matmul is
    never run again (its output is not saved for the backward). None for the head (never
    checkpointed) and for timings made without it.
    """

    forward_s: float  # forward without autograd
    backward_s: float  # backward proper (forward with autograd excluded)
    checkpointed_s: float | None = None


def measure_layer_costs(shape: ShapeConfig, reps: int = 5, threads: int = 1, seed: int = 0) -> list[LayerTiming]:
    """Time each layer (blocks, then head + loss) on one microbatch with ``threads`` threads.

    The bound schedules' split and the cost model of ``cpu_peers.py`` use these numbers. Other
    work on a shared machine only ever adds time, so the fastest of ``reps`` runs (after one
    warm-up) is the estimate of what the layer costs on its own. Blocks are also timed under
    ``torch.utils.checkpoint`` (``LayerTiming.checkpointed_s``), the head is not.
    """
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        blocks, head = build_layers(shape, seed)
        mb = max(1, shape.batch // shape.microbatches)
        g = torch.Generator().manual_seed(seed + 7)
        x = torch.randn(mb, shape.seq_len, shape.hidden, generator=g)
        y = torch.randint(0, shape.vocab, (mb, shape.seq_len), generator=g)
        out = []
        for layer in list(blocks) + [head]:
            is_head = layer is head

            def run(grad: bool):
                inp = x.detach().requires_grad_(grad)
                with torch.set_grad_enabled(grad):
                    o = layer(inp)
                    if is_head:
                        o = token_loss(o, y)
                return inp, o

            def run_checkpointed():
                inp = x.detach().requires_grad_(True)
                checkpoint(layer, inp, use_reentrant=False).sum().backward()

            fwd, full, ckpt = [], [], []
            for r in range(reps + 1):
                t0 = time.perf_counter()
                run(False)
                t1 = time.perf_counter()
                inp, o = run(True)
                (o if o.dim() == 0 else o.sum()).backward()
                t2 = time.perf_counter()
                layer.zero_grad(set_to_none=True)
                if not is_head:
                    t3 = time.perf_counter()
                    run_checkpointed()
                    ckpt.append(time.perf_counter() - t3)
                    layer.zero_grad(set_to_none=True)
                if r:  # the first round warms up
                    fwd.append(t1 - t0)
                    full.append(t2 - t1)
            f = min(fwd)
            out.append(LayerTiming(forward_s=f, backward_s=max(min(full) - f, 0.0),
                                   checkpointed_s=None if is_head else min(ckpt[1:])))
        return out
    finally:
        torch.set_num_threads(old_threads)


def param_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters."""
    return sum(p.numel() * p.element_size() for p in module.parameters())
