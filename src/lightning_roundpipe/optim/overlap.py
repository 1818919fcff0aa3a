"""The user's optimizer, stepped layer by layer on a host thread, hidden behind the pipeline.

Exact by default: each layer steps on its complete gradient of the step, and the next forward's
upload of a layer waits only for that layer's new version (``upload_waits_for``), so results equal
the synchronous ``optimizer.step()`` bit for bit. Layers step during the last backward only
when nothing between backward and the step can change gradients; under a loss scaler each layer
unscales and checks its own gradients, and an overflow puts every stepped layer back. A failed
step is undone from a bounded journal (``step_undo.py``); layers beyond it wait until the step
is known good. When a layer may step early, loss scaling and
``staleness=1``: docs/design.md, design notes, ``optim/overlap.py``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch

from ..errors import LayerStepSkipped, PipelineError, PipelineTimeout, StepFailed
from ..workers.completions import Completion, TaskLabel
from .host_lane import HostLane
from .loss_scale import StepUnscale
from .per_layer_support import declaration_hint, why_not_per_layer
from .step_undo import BeforeImages, KnownGood, StepUndo, capture_ahead, layers_named, note_put_back, plan_journal
from .user_optimizer import LayerUnits, LayerUpdate, LayerView, layout_of
from .overlap_config import OverlapConfig

REST = -1  # the key of the parameters outside the pipeline among ``versions`` (loss-scaled steps)


class OverlappedOptimizer:
    """Steps a host optimizer layer by layer behind the pipeline (see the module doc)."""
    def __init__(self, optimizer: torch.optim.Optimizer, config: OverlapConfig, engine, trace, *,
                 before_layer_step: Callable[[list[torch.Tensor]], None] | None = None,
                 loss_scaler: "torch.amp.GradScaler | None" = None):
        """``config``: how it steps (``OverlapConfig``): ``staleness``; ``early_steps``, layers may step
        during the step's last backward; ``timeout_s``, the longest any wait here may take; ``undo``, keep
        each step's before-images so a failed step is put back (default). False (for models whose host
        memory cannot hold one more copy of the weights and optimizer state): a failed step raises
        naming the layers it updated, and every later ``step``, ``join`` and ``state_dict`` refuses until
        ``mark_restored`` (after loading a checkpoint). ``journal_bytes``: the most bytes of
        before-images one step keeps (the undo journal; None: every layer's); layers past it step once
        the step is known good, without a copy (see the module doc). The parameters outside the
        pipelined module are always copied.
        ``engine``: the ``PipelineEngine`` whose layers it steps: their tables, its ``PipelineCalls``
        (early steps), its pool (told of new weight versions) and its ``ShadowStore`` (``staleness=1``
        keeps the previous weights there, refreshed after each layer step; ``state_dict`` saves them).
        ``before_layer_step``: called with a layer's parameters just before it steps (e.g. to wait
        for the node all-reduce).
        ``loss_scaler``: the (enabled) ``torch.amp.GradScaler`` that scaled the loss whose gradients
        this optimizer steps with; ``step(closure)`` then unscales and checks each layer's
        gradients on the lane before it steps, and skips the whole step when any overflowed,
        putting back the layers that stepped early and recording the overflow for the scaler's
        ``update()`` (see "Under a loss scaler" in the module doc). Needs ``staleness=0`` and ``undo``."""
        staleness, early_steps, undo, timeout_s = config.staleness, config.early_steps, config.undo, config.timeout_s
        delay_per_layer_s, journal_bytes = config.delay_per_layer_s, config.journal_bytes
        layer_tables, notifier, calls, shadows = engine.tables, engine.pool, engine.calls, engine.shadows
        after_layer_step = refresh_shadows = shadows.refresh if shadows is not None else None
        if loss_scaler is not None and (staleness or not undo):
            raise ValueError("the overlapped optimizer unscales layer by layer under a loss scaler only with staleness=0 "
                             "and undo=True (layers that stepped early are put back when a later layer overflows); "
                             "without them, run the scaler's unscale_ and step after backward (early_steps=False, no "
                             "loss_scaler)")
        reason = why_not_per_layer(optimizer)
        if reason is not None:
            raise ValueError(f"the overlapped optimizer steps layer by layer, which would not be exact for "
                             f"{type(optimizer).__name__}: {reason}. Step it whole (overlap_optimizer=False; "
                             f"RoundPipeStrategy does so by itself), or, {declaration_hint(optimizer)}")
        if staleness not in (0, 1):
            raise ValueError(f"staleness must be 0 (exact) or 1 (one-step-delayed update), got {staleness}")
        self.optimizer = optimizer
        self.staleness = staleness
        self.delay_per_layer_s = float(delay_per_layer_s)
        self.after_layer_step = after_layer_step
        self.before_layer_step = before_layer_step  # e.g. wait for the node all-reduce
        self._refresh_shadows = refresh_shadows
        self.early_steps = early_steps
        self.in_step = False
        self.timeout_s = float(timeout_s)
        self.calls = calls
        self.shadows = shadows
        self._in_last_backward = False
        self._undo: StepUndo | None = None  # before-images of the step in flight
        self._commit: Completion | None = None
        self._submitted_undo: StepUndo | None = None  # the step whose layer steps ``versions`` holds
        self.keep_undo = bool(undo)
        if journal_bytes is not None and (isinstance(journal_bytes, bool) or int(journal_bytes) < 0):
            raise ValueError(f"journal_bytes must be a byte count >= 0 or None (no bound), got {journal_bytes!r}")
        self.journal_bytes = None if journal_bytes is None else int(journal_bytes)
        self._journaled: set[int] = set()  # this step's units whose before-images the journal holds
        self.journal_used_bytes = 0  # this step's planned before-image bytes (within journal_bytes)
        self.loss_scaler = loss_scaler
        self._unscale: StepUnscale | None = None  # the step in flight's unscaling (loss_scaler set)
        self._skip = False  # skip_step() was called during this step's closure
        self.early_layer_steps = 0  # layer steps submitted during a backward (since construction)
        self.skipped_steps = 0  # loss_scaler: steps skipped whole (an overflow, or skip_step())
        self.before_images = BeforeImages()  # reused by every step's undo (filled only with undo=True)
        self.images_taken_at_step = 0  # layer steps of committed steps whose before-image was not taken ahead
        self.unrestored: list[str] = []  # undo=False: layers a failed step updated, until mark_restored()
        self.replans = 0  # times the optimizer's parameters changed and the per-layer plan was remade
        self._view = LayerView(optimizer)  # steps one unit's parameters with the optimizer's own class
        self._tables = layer_tables
        self._layout: tuple = ()
        self._plan_units()
        self.versions: dict[int, Completion] = {}
        self.lane = HostLane(trace, notifier)
        self._done_layers: set[int] = set()
        self._done_call = None  # the pipelined call whose backward filled _done_layers
        self._submitted: set[int] = set()
        self._submitted_ids: set[int] = set()  # parameters (by id) whose update this step is submitted
        self._superseded: list[Completion] = []  # a unit's earlier submissions of this step (re-planned mid-step)
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ the per-layer plan
    def _plan_units(self) -> None:
        """Group the optimizer's parameters into units (``LayerUnits``), kept in the attributes the steps read."""
        units = LayerUnits.of(self.optimizer, self._tables)
        self.unit_params, self.unit_layers, self.layer_units = units.params, units.layers, units.of_layer
        self.rest, self._layout = units.rest, units.layout

    def replan_if_changed(self) -> bool:
        """Re-plan the per-layer steps when the optimizer's parameters changed since the last plan
        (``add_param_group``, ``BaseFinetuning.unfreeze_and_add_param_group``, a group's list edited),
        so parameters that joined are stepped and those that left are not. Hyper-parameters need
        no re-plan (each step snapshots them), nor does freezing (a parameter without ``.grad`` is
        skipped by the optimizer itself). Cheap: one pass over the parameters' identities."""
        if layout_of(self.optimizer) == self._layout:
            return False
        self._plan_units()
        self.replans += 1
        return True

    # ------------------------------------------------------------------ the engine's reports (via the runtime)
    def upload_waits_for(self, layer_ids) -> list[Completion]:
        """The completions an upload of ``layer_ids`` waits for: their layers' pending steps (none with
        staleness)."""
        if self.staleness:
            return []  # uploads read the shadows, which only change between steps
        gates = []
        for l in layer_ids:
            for u in self.layer_units.get(l, ()):
                c = self.versions.get(u)
                if c is not None:
                    gates.append(c)
        return gates

    def on_grads_ready(self, layer_ids) -> None:
        """On the host thread, once a backward stage's gradients are in ``.grad``: step complete layers early."""
        current = self.calls.current if self.calls is not None else None
        if current is not self._done_call:
            # Each call's backward covers every layer: a layer is complete once the backward that
            # runs while no other call is pending has reached it, whatever earlier backwards did.
            self._done_call = current
            self._done_layers = set()
        self._done_layers.update(layer_ids)
        if not (self.in_step and self._in_last_backward and self.early_steps and not self.staleness):
            return
        calls = self.calls
        if calls is None or calls.others_pending():
            return  # another pipelined call of this step still adds to these gradients
        for unit, layers in self.unit_layers.items():
            if unit in self._submitted or not layers <= self._done_layers:
                continue
            if any(id(p) in calls.reached_outside for _, p in self.unit_params[unit]):
                continue  # autograd adds a contribution from outside the pipeline: step after the closure
            if self.keep_undo and unit not in self._journaled:
                continue  # past the undo journal: steps once the step is known good
            self.early_layer_steps += 1
            self._submit(unit, self._snapshot())

    @contextlib.contextmanager
    def last_backward(self):
        """Around the closure's last backward: no pipelined call of this step will follow it, so a
        layer whose gradient is complete may step while backward goes on."""
        self._in_last_backward = True
        try:
            yield
        finally:
            self._in_last_backward = False

    # ------------------------------------------------------------------ optimizer API
    def step(self, closure=None):
        """Step every layer not stepped during backward; exact mode waits for the previous step first.
        Under a ``loss_scaler`` it returns once the step is decided: done, or skipped whole."""
        if not self.staleness:
            self.join()  # exact: the previous step's updates are in (the forward waited for them anyway)
        self._done_layers = set()
        self._done_call = None
        self._submitted = set()
        self._submitted_ids = set()
        self._refuse_if_unrestored()
        self.replan_if_changed()  # parameters added, removed or moved between groups since the last step
        self._undo = StepUndo(self.optimizer, keep=self.keep_undo, images=self.before_images)
        self._unscale = StepUnscale(self.loss_scaler) if self.loss_scaler is not None else None
        self._skip = False
        self._journaled = set()
        if not self.staleness:  # with staleness the previous update may still write the state: plan after its join
            self._plan_journal()
            if self.keep_undo:
                self._capture_ahead(self._undo)
        if self._unscale is not None:
            return self._scaled_step(closure)
        try:
            loss = self._run_closure(closure)
            if self.staleness:
                # The previous update ran behind this step's forward and backward, which read the
                # shadows; now publish it to the shadows, then start this step's update.
                self.join()
                self.refresh_shadows()
                self._plan_journal()
            self.replan_if_changed()  # the closure may have changed the groups too
            hp = self._snapshot()
            later = self._submit_journaled(hp)  # what the units hold that did not step early
            if self.rest:  # parameters outside the pipeline: the caller's next code uses them, step them now
                self._undo.save([p for _, p in self.rest], "parameters outside the pipeline")
                self._view.step(self.rest, hp, self._grads_of(self.rest))
            self._submit_known_good(later, hp)  # past the journal: once the step is known good
        except BaseException as exc:
            self._abandon(exc)
            raise
        undo = self._undo
        self._commit = self.lane.submit(lambda: self._committed(undo), TaskLabel("undo", "commit"), traced=False)
        self.optimizer._opt_called = True  # what LRScheduler checks to know a step happened
        return loss

    def _run_closure(self, closure):
        """The caller's closure (forward and backward), with grad on and ``in_step`` set while it
        runs (layers then step early as their gradients complete); None without a closure."""
        if closure is None:
            return None
        self.in_step = True
        try:
            with torch.enable_grad():
                return closure()
        finally:
            self.in_step = False

    def _committed(self, undo: StepUndo) -> None:
        """On the lane after the step's last layer step: the step succeeded unless it failed meanwhile."""
        if undo.failure is None:
            undo.commit()
            self.images_taken_at_step += undo.taken_at_step

    def skip_step(self) -> None:
        """Under a ``loss_scaler``, called during ``step``'s closure: this step takes no update at all
        (what ``GradScaler`` users get by not calling ``scaler.step``, e.g. Lightning when
        ``training_step`` returned None); any layer stepped early is put back."""
        self._skip = True

    def _scaled_step(self, closure):
        """``step`` under a loss scaler: every layer unscales and checks its gradients on the lane just
        before it steps (early, during the closure's last backward, or after it), and steps only while
        no gradient of the step has overflowed; then the step is decided on the lane: an overflow (or
        ``skip_step``) puts back every layer that stepped, otherwise the step commits. The caller
        then runs the scaler's ``update()``."""
        undo, unscale = self._undo, self._unscale
        try:
            loss = self._run_closure(closure)
            if not self._skip:
                self.replan_if_changed()
                hp = self._snapshot()
                later = self._submit_journaled(hp)
                if self.rest:  # the caller's next code uses them: step() returns only once they are decided too
                    self._submit_params(REST, self.rest, "parameters outside the pipeline", hp, "rest", layer=-1)
                self._submit_known_good(later, hp)
        except BaseException as exc:
            self._abandon(exc)
            raise
        self._commit = self.lane.submit(lambda: self._decide(undo, unscale), TaskLabel("undo", "commit"), traced=False)
        self.join()  # every layer's check is in: the step is done, or skipped whole with every layer as before
        if self._skip:
            self.skipped_steps += 1
            return loss
        unscale.record(self.loss_scaler)
        if unscale.overflowed():
            self.skipped_steps += 1
        else:
            self.optimizer._opt_called = True  # what LRScheduler checks; GradScaler skips step() on overflow
        return loss

    def _decide(self, undo: StepUndo, unscale: StepUnscale) -> None:
        """On the lane after every layer of a loss-scaled step was checked: commit, or put back."""
        if undo.failure is not None:
            return  # the failure put the stepped layers back already
        if self._skip or unscale.overflowed():
            self._restore(undo)
        else:
            self._committed(undo)

    def _abandon(self, exc: BaseException) -> None:
        """The step failed on the host side: let the lane finish, then put back what it stepped."""
        undo = self._undo
        if undo is None:
            return
        if undo.failure is None:
            undo.failure = exc  # queued layer steps of this step skip
        restore = self.lane.submit(lambda: self._restore(undo), TaskLabel("undo", "restore"), traced=False)
        self.versions = {}
        self._superseded = []
        self._commit = None
        note_put_back(exc, undo, restore, self.timeout_s)

    def zero_grad(self, set_to_none: bool = True):
        """Clear the gradients, as ``torch.optim.Optimizer.zero_grad``."""
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
        """staleness=1: copy the masters into the upload shadows (the ``refresh_shadows`` argument)."""
        if self._refresh_shadows is not None:
            self._refresh_shadows()

    # ------------------------------------------------------------------ internals
    def _snapshot(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _grads_of(self, params) -> list:
        # Exact mode joins before anything touches .grad, so a reference is enough; with staleness
        # the next step accumulates into .grad while this update runs, so it gets its own copy.
        if self.staleness:
            return [None if p.grad is None else p.grad.clone() for _, p in params]
        return [p.grad for _, p in params]

    def _capture_ahead(self, undo: StepUndo) -> None:
        """Take the step's before-images on the lane while it is idle (``step_undo.capture_ahead``)."""
        capture_ahead(self.lane, undo, self.unit_params, self._journaled,
                      top_first=self.early_steps and not self.staleness)

    def _plan_journal(self) -> None:
        """Choose this step's journaled units (``step_undo.plan_journal``; none without undo)."""
        self._journaled, self.journal_used_bytes = set(), 0
        if self.keep_undo:
            self._journaled, self.journal_used_bytes = plan_journal(
                self.unit_params, self.rest, self.optimizer.state, self.journal_bytes, self.before_images,
                top_first=self.early_steps and not self.staleness)

    def _pending(self, unit: int):
        """The unit's parameters not submitted yet this step (all of them, unless the plan changed
        after the unit stepped early), marked submitted, with the update's name, stage and layer;
        None when there are none."""
        self._submitted.add(unit)
        params = [(gi, p) for gi, p in self.unit_params[unit] if id(p) not in self._submitted_ids]
        if not params:
            return None
        self._submitted_ids.update(id(p) for _, p in params)
        layers = sorted(self.unit_layers[unit])
        name = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
        return params, name, f"L{layers[0]}-{layers[-1]}", layers[0]

    def _submit(self, unit: int, hp: list[dict]) -> None:
        """Submit the update of the unit's parameters not submitted yet this step (journaled)."""
        pending = self._pending(unit)
        if pending is not None:
            params, name, stage, layer = pending
            self._submit_params(unit, params, name, hp, stage, layer=layer)

    def _submit_journaled(self, hp: list[dict]) -> list[int]:
        """After the closure: submit every journaled unit not submitted yet, in layer order; return
        the others (past the journal), which step once the step is known good."""
        later = []
        for unit in sorted(self.unit_params):  # layer order: the next forward needs layer 0 first
            if self.keep_undo and unit not in self._journaled:
                later.append(unit)
            else:
                self._submit(unit, hp)
        return later

    def _submit_known_good(self, units: list[int], hp: list[dict]) -> None:
        """Submit the updates past the journal, without before-images, behind one ``KnownGood``: the
        first of them to run first reduces and checks the gradients of all of them."""
        gate = KnownGood(self.before_layer_step, self._unscale)
        batch = []
        for unit in units:
            pending = self._pending(unit)
            if pending is not None:
                grads = self._grads_of(pending[0])
                gate.add([p for _, p in pending[0]], grads)
                batch.append((unit, pending, grads))
        for unit, (params, name, stage, layer), grads in batch:  # the gate knows them all before any runs
            self._submit_params(unit, params, name, hp, stage, layer=layer, gate=gate, grads=grads)

    def _submit_params(self, key: int, params, name: str, hp: list[dict], stage: str, layer: int | None = None,
                       gate: "KnownGood | None" = None, grads: list | None = None) -> None:
        """Submit one update; with ``gate`` it runs without a before-image once the gate is open."""
        update = LayerUpdate(name, params, hp, self._grads_of(params) if grads is None else grads, self._undo,
                             self._unscale, gate, self._view, before=self.before_layer_step,
                             after=None if self.staleness else self.after_layer_step, restore=self._restore,
                             skipped=lambda: self._skip, delay_s=self.delay_per_layer_s)
        self._submitted_undo = self._undo
        if key in self.versions:  # the same lowest layer runs later on the lane: gates wait for the new one
            self._superseded.append(self.versions[key])
        self.versions[key] = self.lane.submit(update, TaskLabel("optim", stage, queue="optimizer"), layer=layer,
                                              after_layers=gate is not None)

    def _restore(self, undo: StepUndo) -> None:
        """On the lane (nothing else writes the weights now): put back every layer the step changed."""
        if undo.restored:
            return
        if not undo.keep:
            self.unrestored = list(undo.stepped)
            return
        restored = undo.restore()
        if undo.unjournaled:  # stepped without a before-image (past the journal): cannot go back
            self.unrestored = list(undo.unjournaled)
        if self.after_layer_step is not None and restored:
            self.after_layer_step(restored)  # compute-dtype shadows follow the masters back

    def join(self, timeout: float | None = None) -> None:
        """Wait until every submitted layer step has finished, within ``timeout`` seconds in all
        (default: ``timeout_s``). A failed step raises its error once; by then every layer it had
        stepped is back as before the step."""
        limit = self.timeout_s if timeout is None else float(timeout)
        deadline = time.monotonic() + limit
        pending = self._superseded + list(self.versions.values()) + ([self._commit] if self._commit is not None else [])
        first_error = None
        for c in pending:
            try:
                c.wait(max(0.0, deadline - time.monotonic()), waiter="the optimizer join")
            except PipelineError as err:
                if not c.is_set():
                    undo = self._submitted_undo
                    if undo is not None and undo.failure is None:
                        undo.failure = err  # what is still queued skips; a stuck step puts all back when it returns
                    self.versions = {}
                    self._superseded = []
                    self._commit = None
                    raise PipelineTimeout(
                        f"the optimizer join timed out after {limit:g}s waiting for the optimizer step of "
                        f"{layers_named(c.label)} [{c.label}] (still running on the optimizer lane)") from None
                if first_error is None or (isinstance(first_error, LayerStepSkipped)
                                           and not isinstance(err, LayerStepSkipped)):
                    first_error = err  # the failure itself, not a layer it made skip (whatever ran first)
        self.versions = {}
        self._superseded = []
        self._commit = None
        if first_error is not None:
            raise first_error
        self._refuse_if_unrestored()

    def _refuse_if_unrestored(self) -> None:
        if self.unrestored:
            raise StepFailed(
                f"a failed optimizer step left {', '.join(self.unrestored)} updated and the others not (no copy was "
                "kept to put them back: undo=False, or they stepped past the undo journal's bound): load the weights "
                "and optimizer state from a checkpoint, then call mark_restored(), before training or saving")

    def mark_restored(self) -> None:
        """undo=False: the weights and optimizer state were restored (from a checkpoint) after a failed step."""
        self.unrestored = []

    def close(self) -> None:
        """Join and stop the host thread (idempotent; ``StepRouting.close`` gives the optimizer its methods back)."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self.join()
            except StepFailed:
                if not self.unrestored:  # the refusal to go on is for training and saving, not for closing
                    raise
        finally:
            self.lane.close(self.timeout_s)

    # ------------------------------------------------------------------ checkpoint (staleness=1)
    def state_dict(self) -> dict:
        """What a resume needs beyond the optimizer's own state: with ``staleness=1`` the weights
        the next step's gradient is taken at (the shadows, one update behind the masters), in
        the order of the optimizer's parameters. Joins first."""
        self.join()
        if not self.staleness or self.shadows is None:
            return {"staleness": self.staleness}
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return {"staleness": self.staleness, "previous_weights": self.shadows.copies_of(params)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved (after the model's weights are loaded)."""
        self.join()
        if int(state.get("staleness", 0)) != self.staleness:
            raise ValueError(f"the checkpoint was saved with staleness={state.get('staleness', 0)}, "
                             f"this run has staleness={self.staleness}: resume with the same staleness")
        if state.get("previous_weights"):
            self.shadows.load_copies([p for g in self.optimizer.param_groups for p in g["params"]],
                                     state["previous_weights"])
