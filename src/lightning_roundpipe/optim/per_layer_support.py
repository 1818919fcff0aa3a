"""Which optimizers the overlapped optimizer may step layer by layer, exactly.

The overlapped optimizer runs the optimizer's own ``step`` once per layer, on a view holding
that layer's parameters (``overlap.py``). That equals one ``step()`` over all parameters only
if the update of each parameter reads nothing but its gradient, its hyper-parameters and
``optimizer.state[p]``. An optimizer that keeps anything else (a step counter on the optimizer
or in its parameter groups, Lookahead's slow weights synchronised every k steps, schedule-free's
running sums, a warm-up inside ``step``), or that couples parameters (LBFGS, a global norm),
would count each step N times, lose the counts, or mix layers. Step hooks
(``register_step_pre_hook`` / ``register_step_post_hook``, per optimizer or global) would also
run once per layer.

So per-layer stepping is allowed only for the ``torch.optim`` optimizers below, whose state is
per parameter (checked against their source), used as they are or through a subclass that does
not replace ``step`` and has no step hooks; and for any optimizer class that declares
``roundpipe_per_layer = True`` (its author's promise that the update is per parameter). Any
other optimizer is stepped whole, after backward, exactly as Lightning's default strategy does.
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
