"""A stack of blocks pipelined from inside the model's own ``forward``.

The model's ``forward`` runs on the host unchanged (embedding, head, loss in the host dtype);
each block gets a *relay* as its instance ``forward``: block 0's runs every block through the
pipeline at once, the others check that they are called with the previous block's output and
the same other arguments, and hand it on. What a block "returns" before the last is a stand-in
(``PendingOutput``) that raises ``BlockChainError`` on any use but being passed on, so a
``forward`` that is not a plain chain is refused, never run wrongly. The calling convention, tuple
outputs and the carry: docs/design.md, design notes, ``adapters/block_chain.py``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import BlockChainError
from ..user_patches import remove_instance_attribute, set_instance_attribute

_worker_calls = threading.local()  # >0 while a BlockLayer runs a block (on a worker thread)

METADATA_READS = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.ndim.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.size, torch.Tensor.dim,
})
"""What code between two blocks may ask of a block's output (the stand-in answers these)."""

DECLARE_HINT = ("declare the chain instead: give the module that runs the layers a roundpipe_layers() method "
                "returning them in order (see docs/custom_models.md) and pass RoundPipeStrategy(module='...')")


class PendingOutput(torch.Tensor):
    """Stands for the output of block ``index`` until the next block takes it; any other use raises."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, where: str):
        t = torch.Tensor._make_subclass(cls, torch.empty(like.shape, dtype=like.dtype, device="meta"), False)
        t.where = where
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in METADATA_READS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        where = next((a.where for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, PendingOutput)), "a block")
        raise BlockChainError(
            f"the output of {where} was used outside the chain of blocks ({getattr(func, '__name__', func)}): RoundPipe "
            "pipelines a stack only when each block's output is used just as the next block's first argument. "
            f"Stop using intermediate outputs, or {DECLARE_HINT}"
        )

    def __repr__(self):
        return f"PendingOutput({self.where})"


class PendingValue:
    """Stand-in for a block output that is not a single tensor (a tuple or dict of them)."""

    def __init__(self, where: str):
        self.where = where

    def __repr__(self):
        return f"PendingValue({self.where})"


class IgnoredOutput(PendingOutput):
    """Stands for item ``item`` (> 0) of a tuple a block returns: a chain ignores it, so any use raises."""

    @staticmethod
    def __new__(cls, where: str, item: int):
        t = PendingOutput.__new__(cls, torch.empty(()), where)
        t.item = item
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        used = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, IgnoredOutput))
        raise BlockChainError(
            f"item {used.item} of the output of {used.where} was used outside the chain "
            f"({getattr(func, '__name__', func)}): RoundPipe pipelines a stack whose blocks return tuples only when the "
            f"loop passes item 0 to the next block and ignores the other items (x = block(x)[0]). Stop using them, "
            f"or {DECLARE_HINT}")

    def __repr__(self):
        return f"IgnoredOutput(item {self.item} of {self.where})"


@dataclass(frozen=True)
class TupleOutput:
    """The calling convention of blocks that return a tuple (or list) whose item 0 is the next block's input."""

    kind: type  # tuple or list
    length: int
    none_items: frozenset  # the items that were None (returned as None, not as stand-ins)

    def stand_ins(self, first: Any, where: str):
        """The block's "output" before the pipeline ran: ``first`` as item 0, then IgnoredOutput or None."""
        rest = [None if k in self.none_items else IgnoredOutput(where, k) for k in range(1, self.length)]
        return self.kind([first, *rest])


class ChainArguments:
    """The blocks' arguments after the first, the same for every block; rebuilt per worker device.

    Opaque to the engine (not a pytree), so it reaches every microbatch unchanged. Tensors without
    a batch dimension are kept here on the host and copied once per device and call.
    """

    def __init__(self, spec, slots: list[tuple[str, Any]], constants: list[torch.Tensor]):
        self.spec = spec
        self.slots = slots  # per leaf: ("sample", k), ("const", k) or ("value", v)
        self.constants = constants
        self._on_device: dict[torch.device, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def constants_on(self, device: torch.device) -> list[torch.Tensor]:
        """The constant tensor arguments on ``device``, copied there once and kept for later calls."""
        if all(c.device == device for c in self.constants):
            return self.constants
        with self._lock:
            if device not in self._on_device:
                self._on_device[device] = [c.to(device) for c in self.constants]
            return self._on_device[device]

    def rebuild(self, per_sample, device: torch.device) -> tuple[tuple, dict]:
        """The block's ``(args, kwargs)`` again, from this microbatch's ``per_sample`` tensors and the constants
        on ``device``."""
        constants = self.constants_on(device) if self.constants else []
        leaves = []
        for kind, v in self.slots:
            leaves.append(per_sample[v] if kind == "sample" else constants[v] if kind == "const" else v)
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(args), dict(kwargs)


def _device_of(tree) -> torch.device:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


class BlockLayer(nn.Module):
    """One block as a pipeline layer: takes the carry, calls the block, returns the next carry."""

    def __init__(self, block: nn.Module, last: bool):
        super().__init__()
        self.block = block
        self.last = last
        self.keep_first = False  # the block returns a tuple whose item 0 goes on (see TupleOutput)

    def call_block(self, x, per_sample, arguments):
        """The block's own output for one carry (what the model's loop would get)."""
        args, kwargs = arguments.rebuild(per_sample, _device_of(x))
        _worker_calls.depth = getattr(_worker_calls, "depth", 0) + 1
        try:
            return self.block(x, *args, **kwargs)
        finally:
            _worker_calls.depth -= 1

    def forward(self, carry):
        x, per_sample, arguments = carry
        out = self.call_block(x, per_sample, arguments)
        if self.keep_first:
            out = out[0]
        return out if self.last else (out, per_sample, arguments)


class BlockRelay:
    """A block's instance ``forward`` while its stack is pipelined."""

    def __init__(self, chain: "BlockChain", index: int, block: nn.Module):
        self.chain = chain
        self.index = index
        self.block = block
        self.replaced = vars(block).get("forward")  # an instance forward the user had set, restored on detach
        self.own_forward = self.replaced if self.replaced is not None else type(block).forward.__get__(block)

    @torch.compiler.disable  # a compiled model calls the pipeline as plain Python (a graph break)
    def __call__(self, *args, **kwargs):
        if getattr(_worker_calls, "depth", 0):
            return self.own_forward(*args, **kwargs)
        return self.chain.call(self.index, args, kwargs)

    def install(self) -> None:
        """Route the block's calls through this relay (an instance-level ``forward``)."""
        set_instance_attribute(self.block, "forward", self)

    def remove(self) -> None:
        """Give the block back its own ``forward`` (or the one it had before), if this relay is still installed."""
        if remove_instance_attribute(self.block, "forward", installed=self) and self.replaced is not None:
            set_instance_attribute(self.block, "forward", self.replaced)


def _same(a, b) -> bool:
    """The same argument again: the same object, or a tensor view of the same memory (``self.cos[:t]`` per
    block)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                and a.dtype == b.dtype and a.device == b.device and a.requires_grad == b.requires_grad)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


_UNKNOWN = object()  # the calling convention before the first call found it


class BlockChain:
    """Follows one pass of the model's ``forward`` through the blocks of one stack (host thread)."""

    def __init__(self, path: str, layers: list[BlockLayer], run: Callable[..., Any], block_class: str = "blocks"):
        self.path = path
        self.block_class = block_class
        self.layers = layers
        self.n = len(layers)
        self.run = run  # runtime.run: one pipelined call
        self.convention: Any = _UNKNOWN  # None: blocks return a tensor; else a TupleOutput
        self._reset()

    def _reset(self) -> None:
        self.expected = 0
        self.pending: Any = None
        self.result: Any = None
        self.others: tuple[list, Any] | None = None
        self.deferred: tuple | None = None  # a tuple convention's carry, run when the last block is called

    def _name(self, i: int) -> str:
        return f"block {i} ({self.path}.{i})" if self.path else f"block {i} of the stack of {self.n} {self.block_class}"

    def call(self, i: int, args: tuple, kwargs: dict):
        """Handle the container's call of block ``i``: the first call starts the pipelined chain, later ones
        must come in order."""
        if i == 0:
            return self._start(args, kwargs)
        if self.expected != i:
            seen = "before block 0" if self.expected == 0 else f"after block {self.expected - 1}"
            self._reset()
            raise BlockChainError(
                f"{self._name(i)} was called {seen}: RoundPipe pipelines a stack only when its blocks are called in "
                f"order 0..{self.n - 1}, each once per pass; {DECLARE_HINT}")
        if not args or args[0] is not self.pending:
            self._reset()
            raise BlockChainError(
                f"{self._name(i)} was not called with the output of block {i - 1} as its first argument: RoundPipe "
                "pipelines a stack only when each block's output goes unchanged into the next block (code between "
                f"two blocks, such as x = x + y, is not a chain); {DECLARE_HINT}")
        leaves, spec = pytree.tree_flatten((args[1:], kwargs))
        handed_on = next((leaf for leaf in leaves if isinstance(leaf, IgnoredOutput)), None)
        if handed_on is not None:
            self._reset()
            raise BlockChainError(
                f"{self._name(i)} got item {handed_on.item} of the output of {handed_on.where} as an "
                "argument: the blocks hand values other than item 0 from block to block (as T5's position bias), so "
                "they are not a chain RoundPipe can pipeline. Nothing was run. Pipeline another part of the model, or "
                f"{DECLARE_HINT}")
        ref_leaves, ref_spec = self.others
        if spec != ref_spec or len(leaves) != len(ref_leaves) or not all(map(_same, leaves, ref_leaves)):
            self._reset()
            raise BlockChainError(
                f"{self._name(i)} was called with other arguments than block 0 (beyond the first): RoundPipe pipelines "
                "a stack only when every block gets the same masks, flags and other arguments (the same objects); "
                f"{DECLARE_HINT}")
        self.expected = i + 1
        if i == self.n - 1:
            return self._finish()
        return self._stand_in(i)

    def _finish(self):
        """The last block's output: the pipeline's result (run now for a tuple convention)."""
        if self.deferred is not None:
            carry = self.deferred
            out = self.convention.stand_ins(self.run(carry, tokens=_token_count(carry[0])), self._name(self.n - 1))
        else:
            out = self.result
        self._reset()
        return out

    def _stand_in(self, i: int):
        if self.deferred is not None:
            self.pending = PendingOutput(self.deferred[0], self._name(i))
            return self.convention.stand_ins(self.pending, self._name(i))
        self.pending = (PendingOutput(self.result, self._name(i)) if isinstance(self.result, torch.Tensor)
                        else PendingValue(self._name(i)))
        return self.pending

    def _start(self, args: tuple, kwargs: dict):
        self._reset()
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise BlockChainError(
                f"{self._name(0)} was called without a tensor with a batch dimension as its first positional argument "
                f"(got {type(x).__name__}): RoundPipe splits that tensor into microbatches; {DECLARE_HINT}")
        carry = (x, *split_arguments(x, args[1:], kwargs, self._name(0)))
        if self.convention is _UNKNOWN:
            self.convention = self._calling_convention(carry)
            for layer in self.layers:
                layer.keep_first = self.convention is not None
        self.others = tuple(pytree.tree_flatten((args[1:], kwargs)))
        if self.convention is not None:
            self.deferred = carry
        else:
            self.result = self.run(carry, tokens=_token_count(x))
        self.expected = 1
        if self.n == 1:
            return self._finish()
        return self._stand_in(0)

    def _calling_convention(self, carry) -> TupleOutput | None:
        """What block 0 returns, from one call on the host on the first two samples (see the module doc)."""
        x, per_sample, arguments = carry
        first = self.layers[0]
        rows = min(2, int(x.shape[0]))  # two samples: a training-mode BatchNorm refuses a batch of one
        saved = [(b, b.detach().clone()) for b in first.block.buffers()]
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                out = first.call_block(x[:rows], tuple(t[:rows] for t in per_sample), arguments)
        except Exception:  # the block cannot run on a slice: pipeline it as before; its own error surfaces there
            return None
        finally:
            with torch.no_grad():
                for b, value in saved:
                    b.copy_(value)
        if isinstance(out, torch.Tensor):
            return None
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            if tuple(out[0].shape[1:]) != tuple(x.shape[1:]) or out[0].dtype != x.dtype:
                raise BlockChainError(
                    f"{self._name(0)} returns a tuple whose item 0 ({tuple(out[0].shape[1:])} per sample, {out[0].dtype}) "
                    f"is not shaped like its input ({tuple(x.shape[1:])}, {x.dtype}): RoundPipe pipelines a stack whose "
                    f"blocks return tuples only when item 0 is the next block's input; {DECLARE_HINT}")
            return TupleOutput(type(out), len(out), frozenset(k for k, v in enumerate(out) if v is None))
        raise BlockChainError(
            f"{self._name(0)} returns a {type(out).__name__}: RoundPipe pipelines a stack whose blocks return a tensor, "
            f"or a tuple whose item 0 is the next block's input (x = block(x)[0]); {DECLARE_HINT}")


def _token_count(x: torch.Tensor) -> int:
    return int(x.shape[:-1].numel()) if x.dim() >= 2 else int(x.shape[0])


def is_key_value_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face key/value cache: a mutable object the blocks write into, which
    microbatches must not share (transformers' ``Cache`` classes all have ``update`` and ``get_seq_length``)."""
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


def split_arguments(x: torch.Tensor, args: tuple, kwargs: dict, where: str) -> tuple[tuple, ChainArguments]:
    """(per-sample tensors, ChainArguments) for the arguments after the hidden state ``x``.

    A tensor is per-sample when its dim 0 is the batch size of ``x``. When the batch size is also
    one of ``x``'s other dimensions (batch 8 and sequence 8), a tensor that needs no gradient
    could be either a per-sample mask or a per-position table: refused rather than guessed.
    """
    batch = int(x.shape[0])
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    slots: list[tuple[str, Any]] = []
    per_sample: list[torch.Tensor] = []
    constants: list[torch.Tensor] = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            if is_key_value_cache(leaf):
                raise BlockChainError(
                    f"{where} gets a key/value cache ({type(leaf).__name__}) as an argument: each block appends to it, "
                    "so microbatches run one after another would attend to each other's keys. Nothing was run. Call "
                    "the model with use_cache=False (or set model.config.use_cache = False) for training; for a "
                    "Hugging Face causal LM or sequence/token classifier, pipeline the whole model instead (module= "
                    "naming the model, not its layers), which handles the cache itself")
            slots.append(("value", leaf))
            continue
        if leaf.dim() >= 1 and int(leaf.shape[0]) == batch:
            if not leaf.requires_grad and batch in tuple(int(s) for s in x.shape[1:]):
                raise BlockChainError(
                    f"{where} gets a tensor argument of shape {tuple(leaf.shape)} whose dim 0 equals the batch size "
                    f"{batch}, which is also a dimension of the hidden state {tuple(x.shape)}: RoundPipe cannot tell "
                    "whether to split it into microbatches. Use a batch size that differs from the other dimensions "
                    "(e.g. the sequence length)")
            slots.append(("sample", len(per_sample)))
            per_sample.append(leaf)
            continue
        if leaf.requires_grad:
            raise BlockChainError(
                f"{where} gets a tensor argument of shape {tuple(leaf.shape)} that requires grad but has no batch "
                f"dimension (dim 0 is not the batch size {batch}): its gradient would be the sum over microbatches, "
                "which RoundPipe does not form. Compute it inside the blocks, or pass it detached if it needs no "
                "gradient")
        slots.append(("const", len(constants)))
        constants.append(leaf)
    return tuple(per_sample), ChainArguments(spec, slots, constants)
