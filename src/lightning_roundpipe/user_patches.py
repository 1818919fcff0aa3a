"""Every change RoundPipe makes to an object it does not own, listed once with its reason.

``USER_PATCHES`` names each change, the functions that make it, what undoes it, and why it is
needed; the instance attributes RoundPipe sets on the user's module, optimizer and data loaders
are set and removed through the functions below, so making and undoing them is in one place.
``tests/lightning/test_user_patches.py`` scans the package for writes to other objects'
attributes and fails on one this list does not name, and checks that a fit leaves none behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["USER_PATCHES", "UserPatch", "set_instance_attribute", "remove_instance_attribute", "set_class"]


@dataclass(frozen=True)
class UserPatch:
    """One change to an object RoundPipe does not own."""

    what: str  # the object and attribute changed
    sites: tuple[str, ...]  # "module path:function" that makes or undoes the change
    undone: str  # what puts it back, and when
    why: str  # why the change is needed


USER_PATCHES: tuple[UserPatch, ...] = (
    UserPatch(
        "the pipelined module's forward and __deepcopy__ (instance attributes)",
        ("adapters/target.py:patch_forward", "adapters/target.py:unpatch", "adapters/target.py:PlainCopy.__call__"),
        "unpatch, at the runtime's detach (fit end, failure or teardown)",
        "the LightningModule calls its model unchanged and the call runs the pipeline; a deep copy (an EMA "
        "callback) gets the plain module with the current host weights"),
    UserPatch(
        "each block's forward in a pipelined block stack (BlockRelay)",
        ("adapters/block_chain.py:BlockRelay.install", "adapters/block_chain.py:BlockRelay.remove"),
        "BlockRelay.remove via unpatch at detach; a forward the user had set is put back",
        "the model's own loop calls its blocks one by one; the relay turns those calls into the pipelined chain"),
    UserPatch(
        "a Hugging Face MoE experts module's forward (GroupedExpertsForward)",
        ("adapters/grouped_experts.py:install_grouped_experts",
         "adapters/grouped_experts.py:GroupedExpertsForward.remove"),
        "GroupedExpertsForward.remove via unpatch at detach",
        "moe_experts='grouped_mm'/'padded_bmm' runs the experts as one grouped matmul instead of a loop"),
    UserPatch(
        "optimizer.step and optimizer.zero_grad (instance attributes)",
        ("optim/user_optimizer.py:StepRouting.install", "optim/user_optimizer.py:StepRouting.close"),
        "StepRouting.close at detach: the optimizer's own methods, or the LR scheduler's step wrapper, come back",
        "Lightning's loop and the user call optimizer.step(); under an overlapped optimizer that call finishes an "
        "owed backward tail and steps layer by layer on the host lane"),
    UserPatch(
        "optimizer._opt_called",
        ("optim/overlap.py:OverlappedOptimizer.step", "optim/overlap.py:OverlappedOptimizer._scaled_step"),
        "not undone: the flag torch's LR scheduler reads and resets itself",
        "the routed step replaces the LR scheduler's step wrapper, which would set it; set when a step happened"),
    UserPatch(
        "the LightningModule's parameters, named_parameters and state_dict (instance attributes)",
        ("lightning/weight_reads.py:join_before_reads", "lightning/weight_reads.py:restore"),
        "weight_reads.restore at the strategy's teardown",
        "a read of the weights while layers step on the host lane (during backward, or staleness=1) waits for them"),
    UserPatch(
        "a DataLoader's __class__ (a same-named subclass)",
        ("lightning/concurrent_fits.py:gate_data_draws", "lightning/concurrent_fits.py:ungate"),
        "ungate at the strategy's teardown",
        "its iterators draw from torch's CPU generator while another fit's layers may run; they hold it alone"),
    UserPatch(
        "the forward hooks of the pipelined layers (wrapped in GuardedHook in _forward_hooks)",
        ("engine/layer_call.py:HookGuard.wrap_new", "engine/layer_call.py:HookGuard.unwrap"),
        "HookGuard.unwrap at detach",
        "a hook that keeps a layer's output would keep one microbatch's worker tensor: refused with a clear error"),
    UserPatch(
        "the layers' parameters and buffers, swapped for the worker's copies during one layer call",
        ("engine/layer_call.py:swap",),
        "the same call puts the host tensors back when the layer call returns",
        "a worker runs the user's own layer module on its device copies of the weights"),
    UserPatch(
        "a layer's parameters moved to _buffers or attributes by peft's parametrization",
        ("adapters/target.py:ParameterHomes.restore",),
        "is itself the undo, at detach",
        "peft's LoRA on expert tensors re-registers the tensor a worker swapped in; detach puts each parameter home"),
    UserPatch(
        "the layers' buffers and state attributes during the split-invariance check",
        ("engine/split_invariance.py:_State.restore",),
        "restore, right after the check ran the layers on the host",
        "the check runs the layers whole and per microbatch; what those runs wrote must not stay"),
    UserPatch(
        "a Hugging Face decoder layer's gradient_checkpointing flag, during one stage call",
        ("adapters/hf_layers.py:own_checkpointing_off",),
        "the same context manager, when the call returns",
        "the pipeline already recomputes every stage; HF's reentrant checkpoint inside a stage would drop gradients"),
    UserPatch(
        "the training mode of the model's modules during the first-microbatch self-check",
        ("adapters/hf_self_check.py:check_first_microbatch",),
        "the same function puts every module's mode back",
        "an unverified family is compared with its own forward in a fixed mode before any weight changes"),
    UserPatch(
        "forward hooks on MoE routers and on the causal LM and its decoder (torch's register_forward_*hook)",
        ("adapters/hf_moe.py:RouterTap.__enter__", "adapters/unpipelined_calls.py:DirectDecoderCalls.__init__"),
        "their handles' remove(): RouterTap on exit, DirectDecoderCalls.remove at teardown",
        "router logits for the aux loss; a warning when the decoder is called directly, unpipelined"),
    UserPatch(
        "process-wide settings: fp16 matmul accumulation, dynamo's recompile-limit flag, Lightning's rank",
        ("workers/matmul_accumulation.py:Fp16Accumulation.__init__",
         "workers/matmul_accumulation.py:Fp16Accumulation.release",
         "engine/compile_keys.py:_StrictLimit.__call__", "lightning/strategy.py:RoundPipeStrategy.set_world_ranks"),
        "Fp16Accumulation.release at detach; the dynamo flag when its context exits; the rank is Lightning's own",
        "fp16_accumulation=True asks for it; a recompile limit must not fail a layer call; rank-zero logging"),
)


_MISSING = object()


def set_instance_attribute(obj: Any, name: str, value: Any) -> None:
    """Shadow ``obj.<name>`` by an instance attribute. ``object.__setattr__``, because an
    ``nn.Module``'s own ``__setattr__`` would register a module or parameter value as a child."""
    object.__setattr__(obj, name, value)


def remove_instance_attribute(obj: Any, name: str, installed: Any = _MISSING) -> bool:
    """Remove ``obj``'s instance attribute ``name`` (only while it is still ``installed``, when given):
    the class's attribute shows again. True if one was removed."""
    own = vars(obj)
    if name not in own or (installed is not _MISSING and own[name] is not installed):
        return False
    del own[name]
    return True


def set_class(obj: Any, cls: type) -> None:
    """Give ``obj`` the class ``cls`` (a subclass of its own, or its own back)."""
    obj.__class__ = cls
