"""What the runtime needs for a block stack or a declared chain: the module to patch, the layers, the forward.

Block stack: the layers are the blocks (``BlockLayer``), the code outside the stack stays in the
model's ``forward`` on the host and every block gets a relay (``block_chain``). Declared chain: a
module whose ``roundpipe_layers()`` returns its layers in order has its ``forward`` replaced by
the pipeline of those layers (put the embedding and head in the list to run them on the
workers). Compiled modules are pipelined through their original module, eagerly. Details:
docs/design.md, design notes, ``adapters/stack_runtime.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import StackSetupError
from .block_chain import BlockChain, BlockLayer, BlockRelay
from .stack_search import DECLARED_CHAIN_METHOD, uncompiled


def stack_runtime_parts(module: nn.Module, kind: str, path: str = "") -> tuple[nn.Module, list[nn.Module], Callable]:
    """(module whose forward is patched, layers, forward factory) for ``kind`` "block_stack" or
    "declared_chain"."""
    if kind == "declared_chain":
        return declared_chain_parts(module)
    if kind == "block_stack":
        return block_stack_parts(module, path)
    raise StackSetupError(f"unknown stack kind {kind!r}: use 'block_stack' or 'declared_chain'")


def _unpatched(module: nn.Module, what: str) -> nn.Module:
    if "forward" in vars(module):
        raise StackSetupError(f"{what} already has an instance-level forward; is it pipelined twice?")
    return module


def block_stack_parts(container: nn.Module, path: str) -> tuple[nn.Module, list[nn.Module], Callable]:
    """``(container, blocks, loop)`` of a block stack at ``path``: the list of blocks and how the container's
    forward runs them; refused with ``StackSetupError`` when it is not a plain loop."""
    inner = uncompiled(container)
    if not isinstance(inner, (nn.ModuleList, nn.Sequential)):
        raise StackSetupError(f"{path or 'the stack'} is a {type(inner).__name__}, not an nn.ModuleList or nn.Sequential of blocks")
    where = path or type(inner).__name__
    blocks = [uncompiled(b) for b in inner]
    if not blocks:
        raise StackSetupError(f"the block stack {where} is empty")
    if len({id(b) for b in blocks}) != len(blocks):
        raise StackSetupError(
            f"{where} holds the same block object more than once: each block of a pipelined stack must be its own "
            "module. Declare the chain with roundpipe_layers() instead (see docs/custom_models.md)")
    for i, b in enumerate(blocks):
        if isinstance(vars(b).get("forward"), BlockRelay):
            raise StackSetupError(f"block {i} of {where} is already pipelined; detach the other runtime first")
    _unpatched(inner, where)
    layers = [BlockLayer(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)]
    is_sequential = isinstance(inner, nn.Sequential)

    def make_forward(runtime) -> Callable:
        chain = BlockChain(path, layers, runtime.run, "/".join(sorted({type(b).__name__ for b in blocks})))
        for i, b in enumerate(blocks):
            BlockRelay(chain, i, b).install()
        if not is_sequential:
            return type(inner).forward.__get__(inner)  # a ModuleList is not called; its blocks are

        @torch.compiler.disable
        def forward(x):
            out = chain.call(0, (x,), {})
            for i in range(1, len(blocks)):
                out = chain.call(i, (out,), {})
            return out

        return forward

    return inner, layers, make_forward


def _tokens(carry: Any) -> int | None:
    for leaf in pytree.tree_leaves(carry):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return int(leaf.numel()) if not leaf.is_floating_point() else int(leaf.shape[0])
    return None


def declared_chain_parts(module: nn.Module) -> tuple[nn.Module, list[nn.Module], Callable]:
    """``(module, blocks, loop)`` of a module that declares its own chain of blocks."""
    inner = uncompiled(module)
    name = type(inner).__name__
    declared = getattr(inner, DECLARED_CHAIN_METHOD)()
    try:
        layers = list(declared)
    except TypeError:
        raise StackSetupError(f"{name}.{DECLARED_CHAIN_METHOD}() must return a list of nn.Module layers, "
                              f"got {type(declared).__name__}") from None
    bad = [i for i, layer in enumerate(layers) if not isinstance(layer, nn.Module)]
    if not layers or bad:
        raise StackSetupError(
            f"{name}.{DECLARED_CHAIN_METHOD}() must return a non-empty list of nn.Module layers"
            + (f"; items {bad} are not modules (wrap functions in a small nn.Module)" if bad else ""))
    if any(layer is inner for layer in layers):
        raise StackSetupError(f"{name}.{DECLARED_CHAIN_METHOD}() lists the module itself; list the layers its forward runs")
    _unpatched(inner, name)
    layers = [uncompiled(layer) for layer in layers]

    def make_forward(runtime) -> Callable:
        unchecked = [True]

        @torch.compiler.disable
        def forward(*args, **kwargs):
            if kwargs or not args:
                raise TypeError(
                    f"the pipelined {name} takes its input as positional arguments only (the first layer of "
                    f"{DECLARED_CHAIN_METHOD}() receives one argument, or the tuple of several); got "
                    f"{len(args)} positional and keyword arguments {sorted(kwargs)}")
            carry = args[0] if len(args) == 1 else tuple(args)
            if unchecked[0]:
                check_declared_chain(inner, layers, args)
                unchecked[0] = False
            return runtime.run(carry, tokens=_tokens(carry))

        return forward

    return inner, layers, make_forward


def check_declared_chain(module: nn.Module, layers: list[nn.Module], args: tuple, rtol: float = 1e-4) -> None:
    """Refuse a ``roundpipe_layers()`` that does not compute what ``forward`` computes (first call, first sample).

    Both run on the host without grad, from the same random state, with the module's buffers restored
    afterwards, so the check changes nothing (BatchNorm statistics, the caller's random stream).
    """
    name = type(module).__name__
    sample = pytree.tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() else t, args)
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    seed = 0  # any fixed seed: both runs draw the same dropout masks when the chain is right
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            expected = type(module).forward(module, *sample)
            for b, saved in buffers:
                b.copy_(saved)
            torch.manual_seed(seed)
            got = sample[0] if len(sample) == 1 else tuple(sample)
            for layer in layers:
                got = layer(got)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    g_leaves, g_spec = pytree.tree_flatten(got)
    if e_spec != g_spec:
        raise StackSetupError(
            f"{name}.{DECLARED_CHAIN_METHOD}() does not compute what {name}.forward computes: forward returns "
            f"{e_spec}, the chain of layers {g_spec}. List the layers forward runs, in order, each taking the previous "
            "one's output")
    for e, g in zip(e_leaves, g_leaves):
        if not isinstance(e, torch.Tensor):
            continue
        scale = float(e.detach().abs().max()) if e.numel() and e.is_floating_point() else 1.0
        diff = float((e.detach().double() - g.detach().double()).abs().max()) if e.shape == g.shape else float("inf")
        if diff > rtol * max(scale, 1e-6):
            raise StackSetupError(
                f"{name}.{DECLARED_CHAIN_METHOD}() does not compute what {name}.forward computes: on the first sample "
                f"of the first batch the outputs differ by {diff:.3g} (largest output {scale:.3g}). List the layers "
                "forward runs, in order, each taking the previous one's output (code between them belongs in a layer)")
