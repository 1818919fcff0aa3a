"""The user's optimizer under the pipeline: its calls routed, its parameters by layer, one layer's update.

``StepRouting`` is the one wrapper around the user's optimizer: ``install`` sets ``step`` and
``zero_grad`` as instance attributes (through ``user_patches``), so Lightning's loop, a
closure-taking precision plugin and the user all reach the overlapped optimizer by calling
``optimizer.step()``; ``close`` gives the optimizer its own methods back (or the LR scheduler's
step wrapper that was there). ``LayerUnits`` groups its parameters by pipeline layer;
``LayerView`` steps one group with the optimizer's own class; ``LayerUpdate`` is that step as
it runs on the host lane.
"""

from __future__ import annotations

import collections
import copy
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import LayerStepSkipped
from ..params.weights import group_by_lowest_layer
from ..user_patches import remove_instance_attribute, set_instance_attribute
from .step_undo import failure_note

ROUTED = ("step", "zero_grad")


class StepRouting:
    """Routes ``optimizer.step`` / ``zero_grad`` to ``overlapped``, each first finishing an owed
    backward tail (``finish_backward``: the engine's; ``RoundPipeRuntime.returning_early``): ``step``
    after its closure (whose forward finishes it anyway, overlapped) and before any layer is stepped,
    ``zero_grad`` before it clears."""

    def __init__(self, optimizer: torch.optim.Optimizer, overlapped, finish_backward: Callable[[], None]) -> None:
        """``overlapped``: the ``OverlappedOptimizer`` (``overlap.py``) that steps ``optimizer``."""
        self.optimizer = optimizer
        self.overlapped = overlapped
        self.finish_backward = finish_backward
        self._saved = {k: vars(optimizer)[k] for k in ROUTED if k in vars(optimizer)}  # e.g. an LR scheduler's
        self._installed = False

    def install(self) -> None:
        """Route the optimizer's calls here (instance attributes shadowing its class's methods)."""
        set_instance_attribute(self.optimizer, "step", self.step)
        set_instance_attribute(self.optimizer, "zero_grad", self.zero_grad)
        self._installed = True

    def step(self, closure=None):
        """``optimizer.step``: the overlapped optimizer's step, after the owed backward tail."""
        if closure is None:
            self.finish_backward()
            return self.overlapped.step()

        def closure_then_tail():
            loss = closure()
            self.finish_backward()
            return loss

        return self.overlapped.step(closure_then_tail)

    # An LR scheduler looks for this marker on ``optimizer.step`` (a bound method shows its function's
    # attributes) to know the step still sets ``_opt_called``: the overlapped step sets it itself.
    step._wrapped_by_lr_sched = True

    def zero_grad(self, set_to_none: bool = True):
        """``optimizer.zero_grad``: the overlapped optimizer's, after the owed backward tail."""
        self.finish_backward()
        return self.overlapped.zero_grad(set_to_none)

    def close(self) -> None:
        """Join and stop the overlapped optimizer, then give the optimizer back what it had (idempotent;
        the optimizer's methods come back even when the join raises)."""
        try:
            self.overlapped.close()
        finally:
            if self._installed:
                self._installed = False
                for name in ROUTED:
                    remove_instance_attribute(self.optimizer, name)
                for name, value in self._saved.items():
                    set_instance_attribute(self.optimizer, name, value)


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
