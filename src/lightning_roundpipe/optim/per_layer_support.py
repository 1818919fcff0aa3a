"""Stepping the user's optimizer layer by layer: which optimizers may, which parameters step together, and how.

Stepping one layer at a time equals one ``step()`` only if each parameter's update reads nothing
but its gradient, hyper-parameters and ``optimizer.state[p]``. So it is allowed only for the
``torch.optim`` optimizers listed here (checked against their source), or a subclass that keeps
their ``step`` and has no step hooks, and for a class declaring ``roundpipe_per_layer = True``;
any other is stepped whole after backward, as Lightning's default strategy does. ``LayerUnits``
groups the parameters by pipeline layer; ``LayerView`` steps one group with the optimizer's own
class. Why: docs/design.md, design notes, ``optim/per_layer_support.py``.
"""

from __future__ import annotations

import collections
import copy
import inspect
import time
from dataclasses import dataclass

import torch
import torch.optim.optimizer as torch_optimizer

from ..errors import LayerStepSkipped
from ..params.weights import group_by_lowest_layer
from .step_undo import failure_note

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


def layout_of(optimizer: torch.optim.Optimizer) -> tuple:
    """Which parameters each group holds now (by identity): what the per-layer plan depends on."""
    return tuple(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups)


@dataclass(frozen=True)
class LayerUnits:
    """The optimizer's parameters grouped by the (lowest) pipeline layer that holds them: one unit
    steps as one update on the host lane."""

    params: dict  # unit -> [(group index, parameter)]
    layers: dict  # unit -> the pipeline layers holding its parameters
    of_layer: dict  # layer -> the units it holds parameters of
    rest: list  # [(group index, parameter)] outside the pipelined module
    layout: tuple  # ``layout_of`` the optimizer when planned

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, tables) -> "LayerUnits":
        """Plan the units of ``optimizer`` over the pipeline's layer ``tables``."""
        where: dict[int, tuple[int, torch.Tensor]] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                where[id(p)] = (gi, p)
        params_of, unit_layers = group_by_lowest_layer(tables, set(where))
        of_layer: dict[int, set[int]] = {}
        for unit, layers in unit_layers.items():
            for l in layers:
                of_layer.setdefault(l, set()).add(unit)
        inside = {id(p) for ps in params_of.values() for p in ps}
        return cls({unit: [where[id(p)] for p in ps] for unit, ps in params_of.items()}, unit_layers, of_layer,
                   [where[pid] for pid in where if pid not in inside], layout_of(optimizer))


class LayerView:
    """Steps some of ``optimizer``'s parameters with its own class's ``step``, on a shallow copy that
    holds only them (with their group's hyper-parameters and their state).

    Ghosts: tensors sharing each parameter's storage, with their own .grad. A layer step runs
    on ghosts holding the gradients snapshotted at submission, so the host thread may zero or
    accumulate the real .grad meanwhile; optimizer state stays keyed by the real parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._view = copy.copy(optimizer)
        vars(self._view).pop("step", None)  # our copy: an instance step (an LR scheduler's) is not the class's
        vars(self._view).pop("zero_grad", None)
        self._ghosts: dict[int, torch.Tensor] = {}

    def _ghost(self, p: torch.Tensor) -> torch.Tensor:
        g = self._ghosts.get(id(p))
        if g is None:
            g = p.detach()  # same storage: the update lands in the parameter
            self._ghosts[id(p)] = g
        return g

    def step(self, params, hp: list[dict], grads) -> None:
        """Step ``params`` ([(group index, parameter)]) with ``grads`` and the groups' hyper-parameters ``hp``."""
        groups: dict[int, list] = {}
        state = self.optimizer.state
        view_state: dict = collections.defaultdict(dict)
        for (gi, p), grad in zip(params, grads):
            ghost = self._ghost(p)
            ghost.grad = grad
            if p in state:
                view_state[ghost] = state[p]
            groups.setdefault(gi, []).append((p, ghost))
        view = copy.copy(self._view)  # per call: the host thread steps the parameters outside the pipeline meanwhile
        view.param_groups = [dict(hp[gi], params=[g for _, g in pairs]) for gi, pairs in groups.items()]
        view.state = view_state
        with torch.no_grad():
            type(self.optimizer).step(view)
        for pairs in groups.values():
            for p, ghost in pairs:
                if ghost in view_state and p not in state:
                    state[p] = view_state[ghost]  # first step: adopt the state the optimizer created
                ghost.grad = None


class LayerUpdate:
    """One unit's update as it runs on the host lane: skipped when the step already failed; else it waits
    for the ``gate`` (updates past the undo journal) or reduces (``before``) and unscales its own
    gradients, steps only while no gradient of the step overflowed and the step is not ``skipped()``,
    saves its before-image, steps through ``view`` and refreshes the upload shadows (``after``). A
    failure marks the step failed and puts back (``restore``) every unit it stepped."""

    def __init__(self, name: str, params, hp: list[dict], grads: list, undo, unscale, gate, view: LayerView, *,
                 before, after, restore, skipped, delay_s: float = 0.0) -> None:
        self.name, self.params, self.hp, self.grads = name, params, hp, grads
        self.undo, self.unscale, self.gate, self.view = undo, unscale, gate, view
        self.before, self.after, self.restore, self.skipped, self.delay_s = before, after, restore, skipped, delay_s

    def __call__(self) -> None:
        undo, unscale, tensors = self.undo, self.unscale, [p for _, p in self.params]
        if undo.failure is not None:
            raise LayerStepSkipped(f"the optimizer step of {self.name} was skipped: the step failed "
                                   f"({type(undo.failure).__name__}: {undo.failure})")
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.gate is not None:
                self.gate.open()  # every later update's gradients reduced and checked before any of them steps
            else:
                if self.before is not None:
                    self.before(tensors)
                if unscale is not None:
                    unscale.unscale(self.grads)
            if unscale is not None and (self.skipped() or unscale.overflowed()):
                return  # the step is skipped whole: this layer does not step, and those that did go back
            undo.save(tensors, self.name, journaled=self.gate is None)
            self.view.step(self.params, self.hp, self.grads)
            if self.after is not None:
                self.after(tensors)
            if undo.failure is not None:  # the caller gave up on this step meanwhile (a timeout)
                self.restore(undo)
        except BaseException as exc:
            undo.failure = exc
            self.restore(undo)
            exc.add_note(f"the optimizer step failed in {self.name}; " + failure_note(undo, self.name))
            raise
