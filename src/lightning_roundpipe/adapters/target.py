"""Which module of a LightningModule is pipelined, and how it becomes a list of layers.

Found automatically when unambiguous (one top-level ``nn.Sequential`` or recognised Hugging Face
causal LM, else one block stack or one module declaring ``roundpipe_layers()``), or named by the
user with a dotted path (``RoundPipeStrategy(module="net")``); ``locate`` does the same for a
module given directly (``RoundPipeRuntime.attach``). The module is pipelined by giving its
*instance* a ``forward`` that runs the engine; ``unpatch`` removes it at teardown, so the module
is exactly as it was after ``fit``. The search order: docs/design.md, design notes,
``adapters/target.py``.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ..errors import PipelineTargetError
from ..user_patches import remove_instance_attribute, set_instance_attribute
from .block_chain import BlockRelay
from .grouped_experts import GroupedExpertsForward
from .stack_search import (DECLARED_CHAIN_METHOD, compiled_inner, declares_chain, find_stacks, is_block_container,
                           uncompiled)


STACK_KINDS = ("block_stack", "declared_chain")
"""Target kinds built by ``stack_runtime.stack_runtime_parts``."""

_DECLARE = (f"For a model whose forward is not such a loop, give the module a {DECLARED_CHAIN_METHOD}() method that "
            "returns its layers in order (see docs/custom_models.md)")


@dataclass
class Target:
    """The module to pipeline: its path from the LightningModule, the module itself and how it is pipelined."""
    path: str  # dotted attribute path from the LightningModule
    module: nn.Module  # the module whose forward is replaced (a stack's container for "block_stack")
    kind: str  # "sequential", "causal_lm", "block_stack" or "declared_chain"


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
    inner = compiled_inner(module) if isinstance(module, nn.Module) else None
    if inner is not None and isinstance(uncompiled(inner), nn.Sequential):
        return "block_stack"  # a compiled nn.Sequential: pipelined through its original module
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


def _refuse_compiled_hf(module: Any, where: str) -> None:
    if isinstance(module, nn.Module) and compiled_inner(module) is not None and _is_hf_model(uncompiled(module)):
        raise PipelineTargetError(
            f"{where} is a torch.compile'd Hugging Face model: RoundPipe runs its layers eagerly on the workers and "
            "cannot pipeline it through the compiled wrapper. Pass the model itself (compile nothing, or compile "
            "parts of your own code outside the model)")


def _refuse_unsupported_kind(module: Any, where: str, path: str) -> None:
    """Refuse, before the adapter looks for Llama's attributes, a Hugging Face model whose kind (SSM,
    hybrid, encoder-decoder, vision-language) the causal-LM adapter does not pipeline, saying what is
    supported and whether ``allow_unverified`` or ``module=`` would help."""
    from .hf_families import ENCODER_DECODER, FAMILIES, HYBRID, unsupported_kind

    inner = _base_model(module)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", None)
    kind = unsupported_kind(model_type, config)
    if kind is None:
        return
    stacks = [] if kind == ENCODER_DECODER else find_stacks(inner, "" if inner is module else "base_model.model.")
    where_path = path or "<path to the model>"
    if stacks:
        suggested = " or ".join(f"RoundPipeStrategy(module='{where_path}.{s.path}')" for s in stacks)
        module_help = (f"module= can pipeline its stack of blocks alone ({', '.join(s.describe() for s in stacks)}): "
                       f"{suggested} (plain PyTorch: RoundPipeRuntime.attach(model.{stacks[0].path})); the rest of "
                       "its forward runs on the host, and a stack whose blocks hand other values along is refused on "
                       "the first call, before any weight changes")
    elif kind == ENCODER_DECODER:
        module_help = ("module= would not help either: its blocks hand values other than the hidden states along "
                       "(T5's position bias, the encoder's states for the decoder's cross-attention), which a "
                       "pipelined stack of blocks refuses. Train it with Lightning's default strategy")
    else:
        module_help = ("module= would not help either: " + ("its layers are not one stack of like blocks"
                                                            if kind == HYBRID else "RoundPipe found no stack of "
                                                            "blocks in it") + ". Train it with Lightning's default strategy")
    raise PipelineTargetError(
        f"{where} is a {type(inner).__name__} (model_type={model_type!r}): {kind}, which RoundPipe's causal-LM "
        "adapter does not support. It pipelines decoder-only causal LMs whose forward is embeddings -> decoder "
        f"layers -> norm -> head: the verified families {', '.join(sorted(FAMILIES))} (docs/models.md), an "
        "nn.Sequential, or a stack of blocks named with module=. allow_unverified=True would not help: it accepts "
        f"only decoder-only causal LMs laid out like those families. {module_help}.")


def _base_model(module: Any) -> Any:
    """A peft model's base model; any other module itself."""
    get_base = getattr(module, "get_base_model", None)
    return get_base() if callable(get_base) and _is_hf_model(module) else module


def _the_one_stack(stacks: list, several: str) -> Target:
    """The target for the only block stack found; ``several`` (a message with ``{}`` for the list) if more."""
    if len(stacks) > 1:
        raise PipelineTargetError(several.format(", ".join(s.describe() for s in stacks)))
    return Target(stacks[0].path, stacks[0].module, stacks[0].kind)


def _named(module: nn.Module, path: str, where: str) -> Target:
    """The target for a module the user named (or handed to ``attach``)."""
    kind = _kind_of(module)
    if kind == "causal_lm":
        _refuse_unsupported_kind(module, where, path)
    if kind is not None:
        return Target(path, module, kind)
    _refuse_compiled_hf(module, where)
    if declares_chain(module):
        return Target(path, module, "declared_chain")
    if is_block_container(module):
        return Target(path, module, "block_stack")
    inner = compiled_inner(module)
    prefix = f"{path}." if path else ""
    stacks = find_stacks(uncompiled(module), prefix + ("_orig_mod." if inner is not None else ""), _is_hf_model)
    if stacks:
        return _the_one_stack(stacks, f"{where} holds several block stacks: {{}}. Name one of them "
                              "(the others run unpipelined on the host)")
    raise PipelineTargetError(
        f"{where} names a {type(module).__name__}, which RoundPipe cannot split into layers: use an nn.Sequential of "
        "layers, a model whose forward applies an nn.ModuleList of blocks one after another (or the list itself), "
        "or a supported Hugging Face causal LM (Llama, Qwen2, Qwen3, Mistral, or a peft model wrapping one). "
        + _DECLARE
    )


def locate(module: nn.Module) -> Target:
    """The target for a module handed to ``RoundPipeRuntime.attach`` (its path is relative to ``module``)."""
    return _named(module, "", f"RoundPipeRuntime.attach({type(module).__name__})")


def find_target(lightning_module: nn.Module, path: str | None = None) -> Target:
    """The module to pipeline in ``lightning_module``: the one at ``path``, else its only candidate child
    (or its only block stack); several or none are refused, naming what was found."""
    if path:
        return _named(_resolve(lightning_module, path), path, f"RoundPipeStrategy(module={path!r})")
    found = [(name, child, _kind_of(child)) for name, child in lightning_module.named_children()]
    found = [(n, c, k) for n, c, k in found if k is not None]
    if len(found) == 1:
        name, child, kind = found[0]
        if kind == "causal_lm":
            _refuse_unsupported_kind(child, f"{type(lightning_module).__name__}.{name}", name)
        return Target(name, child, kind)
    cls = type(lightning_module).__name__
    if found:
        names = ", ".join(f"{n} ({type(c).__name__})" for n, c, _ in found)
        raise PipelineTargetError(
            f"RoundPipe found several modules it could pipeline in {cls}: {names}. Name one with "
            "RoundPipeStrategy(module='...')"
        )
    for name, child in lightning_module.named_children():
        _refuse_compiled_hf(child, f"{cls}.{name}")
    stacks = find_stacks(lightning_module, skip=_is_hf_model)
    if stacks:
        return _the_one_stack(stacks, f"RoundPipe found several block stacks in {cls}: {{}}. Name the one to pipeline "
                              f"with RoundPipeStrategy(module='{stacks[-1].path}') (the others run unpipelined on the host)")
    nested = _nested_hf_models(lightning_module)
    if nested:
        named = " or ".join(f"RoundPipeStrategy(module='{p}')" for p, _ in nested)
        found_text = ", ".join(f"{p} ({type(m).__name__})" for p, m in nested)
        raise PipelineTargetError(
            f"RoundPipe found no module to pipeline at the top level of {cls}, but it holds a Hugging Face model "
            f"below it: {found_text}. Name it: {named}")
    raise PipelineTargetError(
        f"RoundPipe found no module to pipeline in {cls}: it looks for one top-level nn.Sequential attribute, one "
        "supported Hugging Face causal LM, or one stack of blocks (an nn.ModuleList of blocks applied one after another "
        "in forward). Put the layers in an nn.Sequential attribute, or pass "
        f"RoundPipeStrategy(module='dotted.path.to.module'). {_DECLARE}"
    )


def _nested_hf_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face models below ``root``'s children (``self.model.lm``), with their paths."""
    found: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if _is_hf_model(child):
                found.append((path, child))
            else:
                visit(child, path + ".")

    for name, child in root.named_children():
        if not _is_hf_model(child):
            visit(child, name + ".")
    return found


def _is_causal_lm_class(model: nn.Module) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(value if isinstance(value, (tuple, list)) else (value,))
    return type(model).__name__ in names


def stack_hint(model: nn.Module, path: str | None = None) -> str:
    """For a Hugging Face model that is not a causal LM (BERT, T5, a classification head): the ``module=`` that
    pipelines its stack of blocks, as a sentence to append to the adapter's refusal ("" when there is none)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is optional
        PeftModel = ()
    inner = model.get_base_model() if PeftModel and isinstance(model, PeftModel) else model
    prefix = "" if inner is model else "base_model.model."
    if _is_causal_lm_class(inner):
        return ""
    stacks = find_stacks(inner, prefix)
    if not stacks:
        return ""
    where = path or "<path to the model>"
    listed = ", ".join(s.describe() for s in stacks)
    suggested = " or ".join(f"RoundPipeStrategy(module='{where}.{s.path}')" for s in stacks)
    return (f"It is not a causal LM, but it is built from {'a stack' if len(stacks) == 1 else 'stacks'} of blocks, "
            f"{listed}, which can be pipelined by itself: {suggested} (plain PyTorch: "
            f"RoundPipeRuntime.attach(model.{stacks[0].path})); the code around the stack runs on the host. That works "
            "when its forward passes each block's output to the next block (a stack whose blocks hand other values "
            "along, as T5's position bias, is refused on the first call, before any weight changes).")


class ParameterHomes:
    """Where every parameter under a module lives at attach, so that ``restore`` can put back one that a
    layer's forward moved: peft's LoRA on expert tensors (``target_parameters``) registers a parametrization
    on the tensor a worker swapped in and removes it again, which re-registers that plain tensor as a
    buffer, and the swap then puts the module's own parameter back into ``_buffers`` (``engine/layer_call.py``)."""

    def __init__(self, root: nn.Module):
        self.homes = [(m, list(m._parameters.items())) for m in root.modules() if m._parameters]

    def restore(self) -> None:
        """Move each recorded parameter that now sits in its module's ``_buffers`` (or is an attribute) back
        into ``_parameters``, in the order they had."""
        for module, items in self.homes:
            back = {}
            for key, param in items:
                if key in module._parameters:
                    continue
                if module._buffers.get(key) is param:
                    del module._buffers[key]
                    module._non_persistent_buffers_set.discard(key)
                    back[key] = param
                elif vars(module).get(key) is param:
                    del vars(module)[key]
                    back[key] = param
                # else: replaced by something else since, the module's own change: left alone
            if not back:
                continue
            current = {**module._parameters, **back}
            recorded = [k for k, _ in items if k in current]
            module._parameters.clear()
            for key in recorded + [k for k in current if k not in recorded]:
                module._parameters[key] = current[key]


_STRIPPED = object()  # what a pipeline attribute becomes in a deep copy; removed from the copy afterwards


class PlainCopy:
    """The pipelined module's instance ``__deepcopy__`` (``copy.deepcopy`` looks it up on the instance): the
    copy is the module as it was before pipelining, a plain module with the current host weights. The pool,
    its threads and locks stay with the original, which stays pipelined. ``before_copy``: called first
    (the runtime's ``join``: an owed backward tail and the overlapped optimizer's steps land in the weights)."""

    def __init__(self, module: nn.Module, before_copy: Callable[[], None] | None):
        self.module = weakref.ref(module)
        self.before_copy = before_copy

    def __call__(self, memo: dict) -> nn.Module:
        module = self.module()
        if self.before_copy is not None:
            self.before_copy()
        relays = {}  # marker -> relay: a block's own earlier instance forward, if any, is copied in its place
        for m in module.modules():  # the pipeline's instance forwards are not copied
            installed = vars(m).get("forward")
            if m is module:
                memo[id(installed)] = _STRIPPED
            elif isinstance(installed, (BlockRelay, GroupedExpertsForward)):
                marker = object()
                relays[id(marker)] = (marker, installed)
                memo[id(installed)] = marker
        memo[id(self)] = _STRIPPED
        new = type(module).__new__(type(module))
        memo[id(module)] = new
        new.__setstate__(copy.deepcopy(dict(vars(module)), memo))
        for m in new.modules():
            for key in [k for k, v in vars(m).items() if v is _STRIPPED]:
                remove_instance_attribute(m, key)
            entry = relays.get(id(vars(m).get("forward")))
            if entry is not None:
                replaced = getattr(entry[1], "replaced", None)
                remove_instance_attribute(m, "forward")
                if replaced is not None:
                    set_instance_attribute(m, "forward", copy.deepcopy(replaced, memo))
        return new


def patch_forward(module: nn.Module, forward: Callable, before_copy: Callable[[], None] | None = None) -> None:
    """Give ``module`` an instance-level ``forward`` (the pipelined one); refused if it already has one.
    ``copy.deepcopy`` of the module then gives a plain, unpipelined copy (``PlainCopy``, ``before_copy`` first)."""
    if "forward" in vars(module):
        raise PipelineTargetError(f"{type(module).__name__} already has an instance-level forward; is it pipelined twice?")
    set_instance_attribute(module, "forward", forward)  # shadows the class's forward, leaves everything else alone
    set_instance_attribute(module, "__deepcopy__", PlainCopy(module, before_copy))


def unpatch(module: nn.Module) -> None:
    """Undo ``patch_forward`` and remove every relay installed below ``module``."""
    remove_instance_attribute(module, "forward")
    if isinstance(vars(module).get("__deepcopy__"), PlainCopy):
        remove_instance_attribute(module, "__deepcopy__")
    for m in module.modules():  # the relays a block stack's blocks got (see block_chain), grouped experts
        relay = vars(m).get("forward")
        if isinstance(relay, (BlockRelay, GroupedExpertsForward)):
            relay.remove()
