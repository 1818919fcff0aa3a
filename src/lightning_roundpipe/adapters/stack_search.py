"""Where a model keeps its stack of blocks, and which modules declare their own chain of layers.

A *block stack* is an ``nn.ModuleList`` (or a nested ``nn.Sequential``) of blocks: modules of one
class with submodules of their own, so lists of bare layers are not taken for the backbone. A
*declared chain* is a module with ``roundpipe_layers()``. The search does not look inside either
(an MoE block's expert list is never a candidate) and looks through ``torch.compile``'s wrapper.
Details: docs/design.md, design notes, ``adapters/stack_search.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

DECLARED_CHAIN_METHOD = "roundpipe_layers"
"""Name of the method a module defines to declare its chain of layers."""


@dataclass(frozen=True)
class StackCandidate:
    """A place in a module where a stack of blocks was found: its path, the module and how it is pipelined."""
    path: str  # dotted attribute path from the module searched
    module: nn.Module  # the container (or the declaring module), possibly compiled
    kind: str  # "block_stack" or "declared_chain"

    def describe(self) -> str:
        """The candidate as the error and log messages name it: its path and what kind of stack it is."""
        inner = uncompiled(self.module)
        if self.kind == "declared_chain":
            return f"{self.path} ({type(inner).__name__}.{DECLARED_CHAIN_METHOD})"
        names = sorted({type(uncompiled(b)).__name__ for b in inner.children()})
        return f"{self.path} ({len(inner)} x {'/'.join(names)})"


def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module ``torch.compile`` wrapped, or None when ``module`` is not compiled."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without dynamo
        return None
    if isinstance(module, OptimizedModule):
        return module._orig_mod
    return None


def uncompiled(module: nn.Module) -> nn.Module:
    """The module under every ``torch.compile`` wrapper around it."""
    inner = compiled_inner(module)
    while inner is not None:
        module, inner = inner, compiled_inner(inner)
    return module


def declares_chain(module: nn.Module) -> bool:
    """Whether the module's class declares its own chain of blocks."""
    return callable(getattr(type(uncompiled(module)), DECLARED_CHAIN_METHOD, None))


def is_block_container(module: nn.Module) -> bool:
    """An nn.ModuleList or nn.Sequential (compiled or not): what ``module=`` may name as a stack."""
    return isinstance(uncompiled(module), (nn.ModuleList, nn.Sequential))


def looks_like_block_stack(module: nn.Module) -> bool:
    """A container of at least one block, all of one class, each with submodules of its own."""
    inner = uncompiled(module)
    if not isinstance(inner, (nn.ModuleList, nn.Sequential)) or len(inner) == 0:
        return False
    blocks = [uncompiled(b) for b in inner.children()]
    if len({type(b) for b in blocks}) != 1:
        return False
    return all(any(True for _ in b.children()) for b in blocks)


def find_stacks(root: nn.Module, prefix: str = "", skip=lambda module: False) -> list[StackCandidate]:
    """Every block stack and declared chain under ``root`` (``root`` itself excluded), outermost first.

    ``skip(module)``: modules not to look into (Hugging Face models, which have their own adapter).
    """
    found: list[StackCandidate] = []
    for name, child in root.named_children():
        path = f"{prefix}{name}"
        if skip(uncompiled(child)):
            continue
        if declares_chain(child):
            found.append(StackCandidate(path, child, "declared_chain"))
            continue
        if looks_like_block_stack(child):
            found.append(StackCandidate(path, child, "block_stack"))
            continue
        inner = compiled_inner(child)
        found.extend(find_stacks(child if inner is None else inner,
                                 f"{path}." if inner is None else f"{path}._orig_mod.", skip))
    return found
