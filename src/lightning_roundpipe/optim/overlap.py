"""The user's optimizer, stepped layer by layer on a host thread, hidden behind the pipeline.

Exact by default: each layer's step uses that layer's complete gradient of the step, and the
next forward's upload of a layer waits only for that layer's new version (``weight_gates``),
so results equal the synchronous ``optimizer.step()`` bit for bit while the step's time hides
behind the rest of backward and the next forward.

When a layer may step early: once all backward stages holding its parameters have added their
gradients, if we are inside ``optimizer.step(closure)`` and nothing between backward and the
step can change gradients (no clipping, no loss scaler, no ``on_before_optimizer_step`` or
``configure_gradient_clipping`` override: the strategy decides and sets ``early_steps``).
Otherwise every layer is submitted right after the closure returns (after clipping), in layer
order, so the next forward's first layers are ready first.

A layer's step runs on a shallow view of the optimizer (same ``state``, its own
``param_groups`` holding only that layer's parameters and the hyper-parameters snapshotted at
submission), so a scheduler changing ``lr`` meanwhile cannot leak into a step already
submitted. This needs an optimizer whose update of a parameter depends only on that
parameter's gradient and state: every ``torch.optim`` optimizer except LBFGS.

``staleness=1`` (RoundPipe's one-step-delayed update, inexact by design): the pipeline reads
weights from host shadows that are refreshed to the previous version only at the end of each
backward, so step t's gradient is taken at the weights from before update t-1 while update
t-1 runs on the masters behind step t's forward and backward.
"""

from __future__ import annotations

import collections
import copy
import threading
import time
from typing import Callable

import torch

from ..params.weights import group_by_lowest_layer
from ..workers.completions import Completion, TaskLabel
from .host_lane import HostLane


class OverlappedOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, layer_tables, trace, *, notifier=None,
                 staleness: int = 0, delay_per_layer_s: float = 0.0,
                 after_layer_step: Callable[[list[torch.Tensor]], None] | None = None):
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("the overlapped optimizer steps layer by layer; LBFGS couples all parameters: "
                             "use RoundPipeStrategy(overlap_optimizer=False)")
        if staleness not in (0, 1):
            raise ValueError(f"staleness must be 0 (exact) or 1 (one-step-delayed update), got {staleness}")
        self.optimizer = optimizer
        self.staleness = staleness
        self.delay_per_layer_s = float(delay_per_layer_s)
        self.after_layer_step = after_layer_step
        self.before_layer_step: Callable[[list[torch.Tensor]], None] | None = None  # e.g. wait for the node all-reduce
        self.early_steps = True
        self.in_step = False
        self._view = copy.copy(optimizer)
        vars(self._view).pop("step", None)
        vars(self._view).pop("zero_grad", None)
        # Units: the optimizer's parameters grouped by the (lowest) pipeline layer that holds them.
        where: dict[int, tuple[int, torch.Tensor]] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                where[id(p)] = (gi, p)
        params_of, self.unit_layers = group_by_lowest_layer(layer_tables, set(where))
        self.unit_params: dict[int, list[tuple[int, torch.Tensor]]] = {
            unit: [where[id(p)] for p in ps] for unit, ps in params_of.items()}
        self.layer_units: dict[int, set[int]] = {}
        for unit, layers in self.unit_layers.items():
            for l in layers:
                self.layer_units.setdefault(l, set()).add(unit)
        inside = {id(p) for ps in params_of.values() for p in ps}
        self.rest = [where[pid] for pid in where if pid not in inside]  # not in the pipelined module
        self.versions: dict[int, Completion] = {}
        self.version_count = 0
        self.lane = HostLane(trace, notifier)
        self._done_layers: set[int] = set()
        self._submitted: set[int] = set()
        self._lock = threading.Lock()
        # Ghosts: tensors sharing each parameter's storage, with their own .grad. A layer step runs
        # on ghosts holding the gradients snapshotted at submission, so the host thread may zero or
        # accumulate the real .grad meanwhile; optimizer state stays keyed by the real parameter.
        self._ghosts: dict[int, torch.Tensor] = {}
        self._saved_attrs = {k: vars(optimizer)[k] for k in ("step", "zero_grad") if k in vars(optimizer)}
        optimizer.step = self.step
        optimizer.zero_grad = self.zero_grad
        self._closed = False

    # ------------------------------------------------------------------ engine hooks
    def weight_gates(self, layer_ids) -> list[Completion]:
        if self.staleness:
            return []  # uploads read the shadows, which only change between steps
        gates = []
        for l in layer_ids:
            for u in self.layer_units.get(l, ()):
                c = self.versions.get(u)
                if c is not None:
                    gates.append(c)
        return gates

    def on_layer_grads(self, layer_ids) -> None:
        """Called by the engine (host thread) once a backward stage's gradients are in ``.grad``."""
        self._done_layers.update(layer_ids)
        if not (self.in_step and self.early_steps and not self.staleness):
            return
        for unit, layers in self.unit_layers.items():
            if unit not in self._submitted and layers <= self._done_layers:
                self._submit(unit, self._snapshot())

    # ------------------------------------------------------------------ optimizer API
    def step(self, closure=None):
        if not self.staleness:
            self.join()  # exact: the previous step's updates are in (the forward waited for them anyway)
        self._done_layers = set()
        self._submitted = set()
        loss = None
        if closure is not None:
            self.in_step = True
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                self.in_step = False
        if self.staleness:
            # The previous update ran behind this step's forward and backward, which read the
            # shadows; now publish it to the shadows, then start this step's update.
            self.join()
            self.refresh_shadows()
        hp = self._snapshot()
        for unit in sorted(self.unit_params):  # layer order: the next forward needs layer 0 first
            if unit not in self._submitted:
                self._submit(unit, hp)
        if self.rest:
            self._run_view(self.rest, hp, self._grads_of(self.rest))  # parameters outside the pipeline
        self.optimizer._opt_called = True  # what LRScheduler checks to know a step happened
        return loss

    def zero_grad(self, set_to_none: bool = True):
        # Submitted layer steps hold their own references to the gradients they read, so dropping
        # .grad needs no wait; zeroing in place does (exact mode reads .grad itself).
        if not self.staleness and not set_to_none:
            self.join()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none or self.staleness:  # a submitted step may still hold the old tensor
                    p.grad = None
                else:
                    p.grad.zero_()

    def refresh_shadows(self) -> None:
        """staleness=1: set by the strategy to copy the masters into the upload shadows."""

    # ------------------------------------------------------------------ internals
    def _snapshot(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _grads_of(self, params) -> list:
        # Exact mode joins before anything touches .grad, so a reference is enough; with staleness
        # the next step accumulates into .grad while this update runs, so it gets its own copy.
        if self.staleness:
            return [None if p.grad is None else p.grad.clone() for _, p in params]
        return [p.grad for _, p in params]

    def _submit(self, unit: int, hp: list[dict]) -> None:
        self._submitted.add(unit)
        params = self.unit_params[unit]
        grads = self._grads_of(params)
        layers = sorted(self.unit_layers[unit])

        def run():
            if self.delay_per_layer_s:
                time.sleep(self.delay_per_layer_s)
            if self.before_layer_step is not None:
                self.before_layer_step([p for _, p in params])
            self._run_view(params, hp, grads)
            if self.after_layer_step is not None and not self.staleness:
                self.after_layer_step([p for _, p in params])

        self.versions[unit] = self.lane.submit(run, TaskLabel("optim", f"L{layers[0]}-{layers[-1]}"))
        self.version_count += 1

    def _ghost(self, p: torch.Tensor) -> torch.Tensor:
        g = self._ghosts.get(id(p))
        if g is None:
            g = p.detach()  # same storage: the update lands in the parameter
            self._ghosts[id(p)] = g
        return g

    def _run_view(self, params, hp, grads) -> None:
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

    def join(self, timeout: float = 600.0) -> None:
        """Wait until every submitted layer step has finished (raises a failed step's error)."""
        for c in list(self.versions.values()):
            c.wait(timeout, waiter="the optimizer join")

    def close(self) -> None:
        """Join, stop the host thread and restore the optimizer's own methods (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.join()
        finally:
            self.lane.close()
            for key in ("step", "zero_grad"):
                vars(self.optimizer).pop(key, None)
            vars(self.optimizer).update(self._saved_attrs)
