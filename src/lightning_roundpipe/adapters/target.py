"""Which module of a LightningModule is pipelined, and how it becomes a list of layers.

Found automatically when unambiguous: exactly one top-level ``nn.Sequential`` attribute, or
exactly one Hugging Face causal LM (plain or peft-wrapped) that the adapter recognises.
Otherwise the user names it with a dotted attribute path (``RoundPipeStrategy(module="net")``).

The module is pipelined by giving its *instance* a ``forward`` that runs the engine; the class,
the parameters and the ``state_dict`` are untouched, and :func:`unpatch` removes the instance
attribute at teardown, so the module is exactly as it was after ``fit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn


class PipelineTargetError(ValueError):
    """No module (or several) could be chosen for pipelining; the message says what to do."""


@dataclass
class Target:
    path: str  # dotted attribute path from the LightningModule
    module: nn.Module  # the module whose forward is replaced
    kind: str  # "sequential" or "causal_lm"


def _resolve(root: nn.Module, path: str) -> Any:
    obj = root
    for part in path.split("."):
        if not hasattr(obj, part):
            raise PipelineTargetError(
                f"RoundPipeStrategy(module={path!r}): {type(obj).__name__} has no attribute {part!r}; "
                "give the dotted path of the attribute that holds the module to pipeline"
            )
        obj = getattr(obj, part)
    return obj


def _kind_of(module: Any) -> str | None:
    if isinstance(module, nn.Sequential):
        return "sequential"
    if _is_hf_model(module):
        return "causal_lm"  # the adapter says precisely what it does not recognise, if anything
    return None


def _is_hf_model(module: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    if isinstance(module, PreTrainedModel):
        return True
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, PeftModel)


def find_target(lightning_module: nn.Module, path: str | None = None) -> Target:
    if path:
        module = _resolve(lightning_module, path)
        kind = _kind_of(module)
        if kind is None:
            raise PipelineTargetError(
                f"RoundPipeStrategy(module={path!r}) names a {type(module).__name__}, which RoundPipe cannot split into "
                "layers: use an nn.Sequential of layers or a supported Hugging Face causal LM "
                "(Llama, Qwen2, Qwen3, Mistral, or a peft model wrapping one)"
            )
        return Target(path, module, kind)
    found = [(name, child, _kind_of(child)) for name, child in lightning_module.named_children()]
    found = [(n, c, k) for n, c, k in found if k is not None]
    if len(found) == 1:
        name, child, kind = found[0]
        return Target(name, child, kind)
    cls = type(lightning_module).__name__
    if not found:
        raise PipelineTargetError(
            f"RoundPipe found no module to pipeline in {cls}: it looks for one top-level nn.Sequential attribute or "
            "one supported Hugging Face causal LM. Put the layers in an nn.Sequential attribute, or pass "
            "RoundPipeStrategy(module='dotted.path.to.module')"
        )
    names = ", ".join(f"{n} ({type(c).__name__})" for n, c, _ in found)
    raise PipelineTargetError(
        f"RoundPipe found several modules it could pipeline in {cls}: {names}. Name one with "
        "RoundPipeStrategy(module='...')"
    )


def patch_forward(module: nn.Module, forward: Callable) -> None:
    if "forward" in vars(module):
        raise PipelineTargetError(f"{type(module).__name__} already has an instance-level forward; is it pipelined twice?")
    module.forward = forward  # instance attribute: shadows the class's forward, leaves everything else alone


def unpatch(module: nn.Module) -> None:
    vars(module).pop("forward", None)
