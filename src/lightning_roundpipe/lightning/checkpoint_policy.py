"""Which weights a checkpoint holds, and how strictly it loads.

``checkpoint_weights="full"`` (the default) saves the whole ``state_dict``, exactly what
Lightning's default strategy saves, so a checkpoint of a LoRA run resumes under any strategy
with no extra code. ``"trainable"`` keeps only trainable parameters and buffers: the small
adapter checkpoint, for runs whose frozen base is rebuilt from its model path.

Loading is as strict as the default strategy's ``load_state_dict(strict=strict)``: an unexpected
key, a missing trainable weight or a shape mismatch fails with PyTorch's own message. The one
exception is the documented case of a trainable-only checkpoint: frozen parameters may be absent
(they keep the values the module was built with) when nothing else is missing or unexpected.

A ``staleness=1`` run's checkpoint also carries, under the key ``"roundpipe"``, what the
one-step-delayed update needs to resume exactly (the weights the next gradient is taken at,
one update behind the saved ones): Lightning's default strategy ignores the key, and
``staleness=0`` checkpoints do not have it.
"""

from __future__ import annotations

from ..workers.completions import PipelineError

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

CHECKPOINT_WEIGHTS = ("full", "trainable")


def checkpoint_state(module: nn.Module, weights: str) -> dict:
    """The module's ``state_dict`` for a checkpoint: all of it, or without frozen parameters."""
    state = module.state_dict()
    if weights == "full":
        return state
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def load_checkpoint_state(module: nn.Module, state: dict, strict: bool) -> None:
    """Load ``state`` as strictly as ``module.load_state_dict(state, strict)``, frozen weights excepted.

    A checkpoint that cannot load is refused before any weight is written (``load_state_dict``
    itself copies the matching tensors first), with the error PyTorch would raise."""
    current = module.state_dict()
    missing = [k for k in current if k not in state]
    unexpected = _unexpected_keys(module, state, current)
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    if strict and missing and set(missing) <= frozen and not unexpected:
        missing = []  # the documented case: a trainable-only checkpoint keeps the frozen base as built
        strict = False
    errors = [f"size mismatch for {k}: copying a param with shape {v.shape} from checkpoint, the shape in current "
              f"model is {current[k].shape}." for k in current
              if (v := state.get(k)) is not None and hasattr(v, "shape") and v.shape != current[k].shape]
    if strict:
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(type(module).__name__, "\n\t".join(errors)))
    module.load_state_dict(state, strict=strict)


def _unexpected_keys(module: nn.Module, state: dict, current: dict) -> list[str]:
    """The keys ``load_state_dict`` reports as unexpected, in its order (module by module, from the root)."""
    found = []

    def visit(m: nn.Module, prefix: str) -> None:
        own = [n for n, _ in m.named_parameters(recurse=False)] + [n for n, _ in m.named_buffers(recurse=False)]
        local = {n for n in own if prefix + n in current}  # persistent ones: those the module's state_dict holds
        children = dict(m.named_children())
        for key in state:
            if key.startswith(prefix):
                name = key[len(prefix):].split(".", 1)[0]
                if name not in children and name not in local:
                    found.append(key)
        for name, child in children.items():
            visit(child, f"{prefix}{name}.")

    visit(module, "")
    return found


OVERLAP_KEY = "roundpipe"


def overlap_state(overlapped) -> dict | None:
    """The checkpoint entry of the overlapped optimizers (one per optimizer, in order); None
    when none has ``staleness=1`` (an exact run needs nothing beyond the optimizer's state)."""
    if not any(ov.staleness for ov in overlapped):
        return None
    return {"overlapped_optimizers": [ov.state_dict() for ov in overlapped]}


def overlap_state_of_finished(overlapped) -> dict | None:
    """:func:`overlap_state` of a fit that has ended; None when its last step failed (nothing to
    resume from: the runtime's ``detach`` raises what went wrong)."""
    try:
        return overlap_state(overlapped)
    except PipelineError:
        return None


def load_overlap_state(overlapped, checkpoint: dict) -> None:
    """Give each overlapped optimizer what :func:`overlap_state` saved; call after the weights are loaded."""
    saved = (checkpoint.get(OVERLAP_KEY) or {}).get("overlapped_optimizers")
    stale = any(ov.staleness for ov in overlapped)
    if saved is None:
        if stale:
            rank_zero_warn("this checkpoint holds no previous weights for staleness=1 (it was saved by a "
                           "staleness=0 run or another strategy): the delayed update restarts from the loaded "
                           "weights, so the run does not continue the one that saved it exactly")
        return
    if not stale:
        return  # exact steps need only the optimizer's own state: the delayed update's weights are moot
    if len(saved) != len(overlapped):
        raise ValueError(f"the checkpoint holds the state of {len(saved)} overlapped optimizer(s), this run has "
                         f"{len(overlapped)}: resume with the same optimizers")
    for ov, state in zip(overlapped, saved):
        ov.load_state_dict(state)
