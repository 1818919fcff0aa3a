"""Which optimizers the overlapped optimizer may step layer by layer, exactly.

Stepping one layer at a time equals one ``step()`` only if each parameter's update reads nothing
but its gradient, hyper-parameters and ``optimizer.state[p]``. So it is allowed only for the
``torch.optim`` optimizers listed here (checked against their source), or a subclass that keeps
their ``step`` and has no step hooks, and for a class declaring ``roundpipe_per_layer = True``;
any other is stepped whole after backward, as Lightning's default strategy does. Why:
docs/design.md, design notes, ``optim/per_layer_support.py``.
"""

from __future__ import annotations

import inspect

import torch
import torch.optim.optimizer as torch_optimizer

PER_PARAMETER_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in (
        "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "Adafactor", "ASGD", "NAdam", "RAdam", "RMSprop",
        "Rprop", "SparseAdam", "Muon")
    if hasattr(torch.optim, name))

DECLARATION = "roundpipe_per_layer"


def why_not_per_layer(optimizer: torch.optim.Optimizer) -> str | None:
    """None when ``optimizer`` may be stepped layer by layer exactly; otherwise the reason it may not."""
    cls = type(optimizer)
    if isinstance(optimizer, torch.optim.LBFGS):
        return "LBFGS couples all parameters (its line search reads every gradient)"
    if _has_step_hooks(optimizer):
        return "it has step hooks (register_step_pre_hook / register_step_post_hook), which would run once per layer"
    if getattr(cls, DECLARATION, False):
        return None
    own_step = inspect.unwrap(cls.step)
    for known in PER_PARAMETER_OPTIMIZERS:
        if isinstance(optimizer, known) and own_step is inspect.unwrap(known.step):
            return None
    if any(isinstance(optimizer, known) for known in PER_PARAMETER_OPTIMIZERS):
        return (f"{cls.__name__} replaces step(), which may keep state outside optimizer.state[p] (a step counter, "
                f"Lookahead, a warm-up) that layer-by-layer stepping would advance once per layer")
    return (f"{cls.__name__} is not one of the torch.optim optimizers known to keep only per-parameter state; "
            "state outside optimizer.state[p] (a step counter, Lookahead, schedule-free, a warm-up) would advance "
            "once per layer")


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    # No public query exists: these are the dictionaries register_step_pre_hook / _post_hook fill.
    own = (getattr(optimizer, "_optimizer_step_pre_hooks", None), getattr(optimizer, "_optimizer_step_post_hooks", None))
    shared = (getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
              getattr(torch_optimizer, "_global_optimizer_post_hooks", None))
    return any(bool(h) for h in own + shared)


def declaration_hint(optimizer: torch.optim.Optimizer) -> str:
    """How the author of an optimizer that is per parameter can say so."""
    return (f"if every parameter's update reads only its gradient, its hyper-parameters and optimizer.state[p], "
            f"set {type(optimizer).__name__}.{DECLARATION} = True")
