"""Microbatches on the host: a batch pytree split along dim 0, the carries between stages, the output merged.

Dataclass batches are split like dicts (``register_batch_types`` makes each dataclass type a pytree
node, once per type). Tensor leaves with a batch dimension are split with ``torch.tensor_split``
(sizes differ by at most one); ``HostRows`` leaves (per-sample facts kept on the host) likewise;
0-dim tensors and other leaves go to every microbatch unchanged. Leaves whose dim 0 disagree are an
error. The caller's output is assembled while the pipeline runs (``OutputAssembly``): no copy of
the whole output is left after the last microbatch.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import MicrobatchError


class HostRows:
    """Per-sample values (a list, one per row of the batch) that are split with the batch but are
    not tensors, so they are never uploaded: facts about a microbatch that a layer reads on the
    host without a device sync (``adapters/mask_facts.py``: whether its rows pad or pack)."""

    __slots__ = ("rows",)

    def __init__(self, rows) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"HostRows({self.rows!r})"


def register_batch_types(tree: Any) -> None:
    """Make every dataclass type in ``tree`` (at any depth under dicts, lists and tuples) a pytree node."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        cls = type(tree)
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(cls)
        children = [getattr(tree, f.name) for f in dataclasses.fields(tree)]
    elif isinstance(tree, dict):
        children = list(tree.values())
    elif isinstance(tree, (list, tuple)):
        children = list(tree)
    else:
        return
    for child in children:
        register_batch_types(child)


def batch_size_of(tree: Any) -> int:
    """The batch size (dim 0) the tensors of ``tree`` share; different sizes are refused naming them."""
    leaves_with_path, _ = pytree.tree_flatten_with_path(tree)
    sizes = {}
    for path, leaf in leaves_with_path:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            sizes.setdefault(int(leaf.shape[0]), pytree.keystr(path))
        elif isinstance(leaf, HostRows):
            sizes.setdefault(len(leaf), pytree.keystr(path))
    if not sizes:
        raise MicrobatchError("the batch has no tensor with a batch dimension (dim 0) to split into microbatches")
    if len(sizes) > 1:
        listed = ", ".join(f"{where} has {n}" for n, where in sizes.items())
        raise MicrobatchError(
            f"batch tensors disagree on dim 0 ({listed}); every tensor with a batch dimension must have the same "
            "size along dim 0 so the batch can be split into microbatches"
        )
    return next(iter(sizes))


_warned_small = set()


def effective_microbatches(batch_size: int, requested: int) -> int:
    """``requested`` microbatches, or ``batch_size`` of them when the batch is smaller (warned once)."""
    if requested < 1:
        raise MicrobatchError(f"microbatches must be >= 1, got {requested}")
    if batch_size == 0:
        raise MicrobatchError("the batch is empty (0 samples along dim 0): there is nothing to split into microbatches. "
                              "Give the pipelined module at least one sample (check the dataset's length and the "
                              "sampler, or skip empty batches before the call); nothing ran")
    if batch_size < requested:
        key = (batch_size, requested)
        if key not in _warned_small:
            _warned_small.add(key)
            warnings.warn(
                f"batch of {batch_size} is smaller than microbatches={requested}; running {batch_size} "
                "microbatches of one sample for this batch (results are unchanged)",
                stacklevel=3,
            )
        return batch_size
    return requested


def split_microbatches(tree: Any, num_microbatches: int) -> list[Any]:
    """``tree`` cut into ``num_microbatches`` trees along dim 0 of its tensors (other leaves repeated)."""
    register_batch_types(tree)
    leaves, spec = pytree.tree_flatten(tree)
    n = batch_size_of(tree)
    m = effective_microbatches(n, num_microbatches)
    columns = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            columns.append(torch.tensor_split(leaf, m, dim=0))
        elif isinstance(leaf, HostRows):  # the rows tensor_split gives the tensors
            columns.append([HostRows(leaf.rows[int(i[0]):int(i[-1]) + 1] if len(i) else [])
                            for i in torch.tensor_split(torch.arange(n), m)])
        else:
            columns.append([leaf] * m)
    return [pytree.tree_unflatten([col[i] for col in columns], spec) for i in range(m)]


def merge_microbatches(outputs: list[Any], merged_leaves: dict[int, torch.Tensor] | None = None) -> Any:
    """Concatenate tensor leaves along dim 0; a non-tensor leaf is taken from the first microbatch.

    ``merged_leaves``: leaves (by flat index) already merged by the caller, used as they are."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    merged = []
    for i, leaf in enumerate(flat[0][0]):
        if merged_leaves and i in merged_leaves:
            merged.append(merged_leaves[i])
        elif isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise MicrobatchError(
                    "the pipelined module returned a 0-dim tensor per microbatch, which cannot be merged into a "
                    "batch; return per-sample values (dim 0 = batch) and reduce after the call"
                )
            merged.append(torch.cat([f[0][i] for f in flat], dim=0))
        else:
            merged.append(leaf)
    return pytree.tree_unflatten(merged, spec)


@dataclass
class HostCarry:
    """A microbatch's carry on the host (activations or gradients between stages): its flattened leaves
    (tensors or plain values) and tree spec."""

    leaves: list
    spec: Any

    @staticmethod
    def of(tree: Any) -> "HostCarry":
        """A carry of ``tree``'s leaves and structure."""
        leaves, spec = pytree.tree_flatten(tree)
        return HostCarry(leaves, spec)

    def tree(self) -> Any:
        """The carry as the original tree."""
        return pytree.tree_unflatten(self.leaves, self.spec)

    def nbytes(self) -> int:
        """Bytes of the carry's tensors."""
        return sum(x.numel() * x.element_size() for x in self.leaves if isinstance(x, torch.Tensor))


# Stacking the microbatch outputs after the last one arrived copies the whole output (a language
# model's logits) while every worker idles; instead each microbatch's output is copied into its rows
# of one batch-sized tensor as soon as it is on the host. A leaf that does not fit that shape is
# stacked with ``torch.cat``: the merged output is the same, bit for bit.


class OutputAssembly:
    """Rows of the merged output, filled microbatch by microbatch (``add``), read with ``merged``.

    ``sizes``: the batch size of every microbatch, in order.
    """

    def __init__(self, sizes: list[int]):
        self.sizes = list(sizes)
        self.offsets = [sum(self.sizes[:m]) for m in range(len(self.sizes))]
        self.buffers: dict[int, torch.Tensor | None] = {}  # leaf index -> batch-sized tensor (None: stacked)
        self.placed = 0  # microbatches added

    def _fits(self, leaf, m: int, first: torch.Tensor | None) -> bool:
        if not (isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and leaf.dim() > 0
                and leaf.shape[0] == self.sizes[m] and leaf.is_contiguous() and not leaf.requires_grad):
            return False
        return first is None or (leaf.shape[1:] == first.shape[1:] and leaf.dtype == first.dtype
                                 and leaf.device == first.device)

    def add(self, m: int, carry: HostCarry) -> None:
        """Copy microbatch ``m``'s output leaves into their rows (in place: ``carry`` then holds views
        of those rows, so the microbatch's own tensors are freed). Microbatches come in order."""
        if len(self.sizes) < 2:
            return  # one microbatch: its output is the merged one, nothing to copy
        for i, leaf in enumerate(carry.leaves):
            if m == 0:
                if not self._fits(leaf, 0, None):
                    self.buffers[i] = None
                    continue
                self.buffers[i] = torch.empty((sum(self.sizes), *leaf.shape[1:]), dtype=leaf.dtype, device=leaf.device)
            buffer = self.buffers.get(i)
            if buffer is None:
                continue
            if not self._fits(leaf, m, buffer):
                self.buffers[i] = None  # stacked after all: the rows copied so far are views the cat reads
                continue
            rows = buffer.narrow(0, self.offsets[m], self.sizes[m])
            rows.copy_(leaf)
            carry.leaves[i] = rows
        self.placed = m + 1

    def merged(self, trees: list[Any]) -> Any:
        """The merged output of ``trees`` (the microbatch outputs, in order): the filled tensors
        where every microbatch was placed, ``torch.cat`` for the other leaves."""
        done = self.placed == len(self.sizes)
        # An alias of each filled tensor, not the tensor the rows are views of: autograd makes the
        # returned tensor hold the call (its grad_fn), and the call holds the rows; a row whose
        # base were that tensor would close a cycle through C++ that Python's collector cannot
        # break, and every call's memory would stay.
        filled = {i: b.detach() for i, b in self.buffers.items() if b is not None} if done else {}
        return merge_microbatches(trees, filled)
