"""Which weights a checkpoint holds, and how strictly it loads.

``checkpoint_weights="full"`` (default) saves exactly what Lightning's default strategy saves;
``"trainable"`` keeps only trainable tensors (the small adapter checkpoint). Loading is as strict
as the default strategy's, except that a trainable-only checkpoint may lack frozen parameters. A
``staleness=1`` checkpoint also carries what the delayed update needs under ``"roundpipe"``; an
optimizer state that does not fit the run's optimizers is refused before any weight loads.
Details: docs/design.md, design notes, ``lightning/checkpoint_policy.py``.
"""

from __future__ import annotations

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from ..errors import PipelineError
from .checkpoint_errors import CheckpointError

CHECKPOINT_WEIGHTS = ("full", "trainable")


def checkpoint_state(module: nn.Module, weights: str) -> dict:
    """The module's ``state_dict`` for a checkpoint: all of it, or without frozen parameters."""
    state = module.state_dict()
    if weights == "full":
        return state
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def load_checkpoint_state(module: nn.Module, state: dict, strict: bool, before_load=None) -> None:
    """Load ``state`` as strictly as ``module.load_state_dict(state, strict)``, frozen weights excepted.

    A checkpoint that cannot load is refused before any weight is written (``load_state_dict``
    itself copies the matching tensors first), with the error PyTorch would raise.
    ``before_load``: called once the state is known to fit, before anything is written (more checks)."""
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
    if before_load is not None:
        before_load()
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
    """``overlap_state`` of a fit that has ended; None when its last step failed (nothing to
    resume from: the runtime's ``detach`` raises what went wrong)."""
    try:
        return overlap_state(overlapped)
    except PipelineError:
        return None


def load_overlap_state(overlapped, checkpoint: dict) -> None:
    """Give each overlapped optimizer what ``overlap_state`` saved; call after the weights are loaded."""
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


def refuse_unloadable_optimizer_states(module, checkpoint: dict) -> None:
    """Raise ``CheckpointError`` when ``checkpoint``'s optimizer states would not load into the
    optimizers ``module.configure_optimizers()`` makes; call before loading anything.

    Each saved state is loaded into a throwaway optimizer the module configures, with every saved
    tensor replaced by a 0-dim one (so the check costs no copy of the state): the same checks
    ``Optimizer.load_state_dict`` makes (group sizes, the state each class reads) then fail here.
    A ``configure_optimizers`` that cannot run this early is not checked."""
    saved = checkpoint.get("optimizer_states")
    if not saved:
        return
    try:
        optimizers = _optimizers_in(module.configure_optimizers())
    except Exception:  # it needs what only the set-up makes: Lightning's own load reports any mismatch
        return
    for i, (opt, state) in enumerate(zip(optimizers, saved)):
        per_param = state.get("state", {})
        skeleton = {"state": {k: {n: torch.zeros(()) if torch.is_tensor(v) else v for n, v in s.items()}
                              for k, s in per_param.items()},
                    "param_groups": state.get("param_groups", [])}
        try:
            opt.load_state_dict(skeleton)
        except Exception as err:
            keys = sorted({n for s in per_param.values() for n in s})
            raise CheckpointError(
                f"the checkpoint's optimizer state does not load into this run's optimizer {i} ({type(opt).__name__}): "
                f"{type(err).__name__}: {err} (its saved per-parameter state holds {keys}). It was saved with another "
                "optimizer or other parameter groups: resume with the optimizer set-up that saved it, or start a new "
                "fit from its weights only (module.load_state_dict(torch.load(path)['state_dict']), no ckpt_path). "
                "Nothing was loaded: the weights and the optimizer are as they were.") from err


def _optimizers_in(conf) -> list[torch.optim.Optimizer]:
    """The optimizers of a ``configure_optimizers`` return value, in order (schedulers skipped)."""
    if isinstance(conf, torch.optim.Optimizer):
        return [conf]
    if isinstance(conf, dict):
        return _optimizers_in(conf.get("optimizer"))
    if isinstance(conf, (list, tuple)):
        return [opt for item in conf for opt in _optimizers_in(item)]
    return []
