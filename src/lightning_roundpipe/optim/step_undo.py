"""What one optimizer step changed, kept until the whole step has succeeded, so a failed step is put back.

Layers step one by one on the optimizer lane, some during backward; if anything fails later, the
host weights and optimizer state must be exactly as before the step. So each layer's parameters
and optimizer state are copied before it steps, ahead while the lane is idle, into a bounded
journal of ``BeforeImages`` reused every step (``optimizer_undo_journal_bytes``); layers beyond
it wait until the step is known good and step without a copy. ``keep=False``
(``optimizer_undo=False``) keeps only the names of the layers stepped, and training then waits
for a checkpoint. Why it is arranged so: docs/design.md, design notes, ``optim/step_undo.py``.
"""

from __future__ import annotations

import collections
import copy
import threading

import torch

from ..errors import PipelineError
from ..workers.completions import TaskLabel

def image_tensors(state: dict, params) -> list[torch.Tensor]:
    """What a before-image of ``params`` copies: each parameter and its optimizer state's tensors."""
    out = []
    for p in params:
        out.append(p)
        st = state.get(p)
        if st is not None:
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


class BeforeImages:
    """Reused copy buffers: per group of parameters stepped together, one flat host buffer for the
    copies of their data and optimizer state tensors, remade only when their layout changes.

    One exactly sized block per layer (several tensors' worth) is large enough that the allocator
    maps it on its own rather than carving it from a thread's heap, where freed and kept blocks
    of the other threads would leave it holes it cannot reuse."""

    _ALIGN = 64

    def __init__(self) -> None:
        self._groups: dict[tuple, tuple[torch.Tensor, tuple, list[int]]] = {}  # -> (flat, layout, offsets)
        self._lock = threading.Lock()  # the host thread saves the parameters outside the pipeline meanwhile
        self.allocations = 0  # flat buffers made: one per layer once every layer has stepped twice

    @classmethod
    def size_of(cls, tensors) -> int:
        """Bytes the copies of ``tensors`` take in one buffer (each rounded up to the alignment)."""
        return sum(-(-t.numel() * t.element_size() // cls._ALIGN) * cls._ALIGN for t in tensors)

    def keep_only(self, groups) -> None:
        """Drop the buffers of every group not in ``groups`` (the journal's layers changed)."""
        keep = set(groups)
        with self._lock:
            self._groups = {g: entry for g, entry in self._groups.items() if g in keep}

    def copies(self, group: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` (host tensors) in the buffer of ``group``, which is made (or remade) to fit."""
        layout = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        with self._lock:
            entry = self._groups.get(group)
        if entry is None or entry[1] != layout:
            offsets, total = [], 0
            for t in tensors:
                offsets.append(total)
                total += -(-t.numel() * t.element_size() // self._ALIGN) * self._ALIGN
            entry = (torch.empty(max(total, 1), dtype=torch.uint8), layout, offsets)
            with self._lock:
                self._groups[group] = entry
                self.allocations += 1
        flat, _, offsets = entry
        out = []
        for t, off in zip(tensors, offsets):
            view = flat[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t.detach())
            out.append(view)
        return out

    def nbytes(self) -> int:
        """Bytes of the kept before-images."""
        with self._lock:
            return sum(flat.numel() for flat, _, _ in self._groups.values())


class StepUndo:
    """The before-images of one step: per parameter its data and optimizer state, taken ahead
    (``capture``, while the lane is idle) or just before its step (``save``); ``restore`` puts back
    those that stepped."""

    def __init__(self, optimizer: torch.optim.Optimizer, keep: bool = True, images: BeforeImages | None = None):
        self.optimizer = optimizer
        self.keep = keep
        self.images = images if images is not None else BeforeImages()
        self.hyper = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        # per captured parameter (by id): (parameter, its data's copy, its state before: key -> copy; None: had none)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor, dict | None]] = {}
        self._stepped_ids: list[int] = []  # parameters whose step ran (or began), in order
        self.stepped: list[str] = []  # names of the layer steps done, in order
        self.unjournaled: list[str] = []  # names of those stepped without a before-image (journal full)
        self.failure: BaseException | None = None
        self.restored = False
        self.finished = False  # committed or restored: nothing more is captured
        self.taken_at_step = 0  # layer steps that found their before-image not taken ahead

    def nbytes(self) -> int:
        """Bytes of the copies this step holds."""
        total = 0
        for _, data, state in self.saved.values():
            total += data.numel() * data.element_size()
            for v in (state or {}).values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    def capture(self, params) -> None:
        """Before-images of those of ``params`` not captured yet (on the lane, before any of them steps)."""
        if not self.keep or self.finished:
            return
        state = self.optimizer.state
        params = [p for p in params if id(p) not in self.saved]  # the first before-image is the one to keep
        tensors, plan = [], []
        for p in params:
            st = state.get(p)
            keys = [k for k, v in st.items() if isinstance(v, torch.Tensor)] if st is not None else []
            plan.append((p, keys))
            tensors.append(p)
            tensors.extend(st[k] for k in keys)
        if not tensors:
            return
        copies = iter(self.images.copies(tuple(id(p) for p in params), tensors))
        for p, keys in plan:
            data = next(copies)
            before = None
            if p in state:
                tensor_copies = {k: next(copies) for k in keys}
                before = {k: tensor_copies[k] if k in tensor_copies else copy.deepcopy(v) for k, v in state[p].items()}
            self.saved[id(p)] = (p, data, before)

    def save(self, params, name: str, journaled: bool = True) -> None:
        """Just before ``params`` step (on the lane): their before-image unless taken ahead, and the
        record that they stepped. ``journaled=False``: no image (the journal is full and the step
        is known good); only the name is kept, for a failure of this very update."""
        self.stepped.append(name)
        if not journaled:
            self.unjournaled.append(name)
        if not self.keep or not journaled:
            return
        params = list(params)
        if any(id(p) not in self.saved for p in params):
            self.taken_at_step += 1
        self.capture(params)
        self._stepped_ids.extend(id(p) for p in params)

    def restore(self) -> list[torch.Tensor]:
        """Put every parameter that stepped and its optimizer state back; return those parameters.

        Values are copied back into the optimizer's own state tensors where the step left one of
        the same shape (the buffers stay ours, for the next step); a state entry the step made
        or replaced otherwise gets a fresh copy. Images taken ahead of layers that never stepped
        are left alone: those layers are as before."""
        if not self.keep:
            return []
        state = self.optimizer.state
        restored, seen = [], set()
        with torch.no_grad():
            for pid in reversed(self._stepped_ids):
                if pid in seen:
                    continue
                seen.add(pid)
                p, data, before = self.saved[pid]
                p.copy_(data)
                if before is None:
                    state.pop(p, None)
                else:
                    now = state.get(p, {})
                    put = {}
                    for k, v in before.items():
                        if not isinstance(v, torch.Tensor):
                            put[k] = v
                        elif (isinstance(now.get(k), torch.Tensor) and now[k].shape == v.shape
                              and now[k].dtype == v.dtype and now[k].device == v.device):
                            put[k] = now[k].copy_(v)
                        else:
                            put[k] = v.clone()
                    state[p] = put
                restored.append(p)
        for group, hyper in zip(self.optimizer.param_groups, self.hyper):
            group.update(hyper)  # a scheduler stepped after a step that failed later
        self.saved = {}
        self.restored = True
        self.finished = True
        return restored

    def commit(self) -> None:
        """The step succeeded: the before-images are no longer needed (their buffers serve the next step)."""
        self.saved = {}
        self.finished = True


def plan_journal(unit_params: dict, rest: list, state: dict, journal_bytes: int | None, images: BeforeImages,
                 top_first: bool) -> tuple[set, int]:
    """This step's journaled units and their before-image bytes: in the order they will step (from
    the top when layers step during backward), each whose image still fits in ``journal_bytes``
    (None: every one). The buffers of units left out are dropped, so the journal never holds more."""
    units = sorted(unit_params)
    if top_first:
        units.reverse()
    journaled, used, keep = set(), 0, []
    for unit in units:
        params = [p for _, p in unit_params[unit]]
        size = BeforeImages.size_of(image_tensors(state, params))
        if journal_bytes is None or used + size <= journal_bytes:
            journaled.add(unit)
            used += size
            keep.append(tuple(id(p) for p in params))
    keep.append(tuple(id(p) for _, p in rest))
    images.keep_only(keep)
    return journaled, used


def capture_ahead(lane, undo: StepUndo, plan: dict, journaled: set, top_first: bool) -> None:
    """Take the before-images of the ``journaled`` units of ``plan`` on ``lane`` (a ``HostLane``) while it
    has nothing else to do (the forward and early backward, once the previous step's updates are in),
    in the order the layers will step, so that a layer whose gradient is complete steps without
    copying first.

    The lane is the only writer of these weights until they step, so an image taken ahead
    equals one taken just before the step. Idle work: before each layer it yields to any
    waiting layer step by going to the back of the queue, and a layer that steps first takes
    its own image (``StepUndo.save``). A copy that fails here is taken again, and fails
    where it is reported, when its layer steps."""
    units = sorted(u for u in plan if u in journaled)  # this step's plan: a re-plan after the closure changes nothing
    if top_first:
        units.reverse()  # the last backward completes the last layers first
    pending = collections.deque(units)
    label = TaskLabel("undo", "capture ahead")

    def run():
        while pending and not undo.finished and undo.failure is None:
            if lane.has_waiting():
                lane.submit(run, label, traced=False)
                return
            undo.capture([p for _, p in plan[pending.popleft()]])

    lane.submit(run, label, traced=False)


def failure_note(undo: StepUndo, failing: str | None = None) -> str:
    """What a failed step had updated and what was put back (``failing``: the update that raised,
    not counted among those done, unless it stepped without a before-image)."""
    stepped = [n for n in undo.stepped if n != failing]
    if not undo.keep:
        return (f"the step had updated {', '.join(stepped) or 'nothing'} (undo=False: not put back; restore from a "
                "checkpoint and call mark_restored() before training or saving)")
    if undo.unjournaled:
        back = [n for n in stepped if n not in undo.unjournaled]
        return (f"the step had updated {', '.join(stepped) or 'nothing'}: {', '.join(back) or 'none'} are back as "
                f"before the step, but {', '.join(undo.unjournaled)} stepped without a before-image (past the undo "
                "journal, optimizer_undo_journal_bytes) and are not: restore from a checkpoint and call "
                "mark_restored() before training or saving")
    return (f"the step had updated {', '.join(stepped) or 'nothing'}: they are back as before the step "
            "(weights and optimizer state)")


class KnownGood:
    """The point after which updates past the undo journal may run without a before-image: opened
    (on the lane, by the first of them, after every journaled update, ``HostLane``'s ``after_layers``)
    it reduces (``before_layer_step``) and unscales every one of their gradients first, so neither a
    reduction nor a loss-scale overflow can fail the step once the first of them has stepped."""

    def __init__(self, before_layer_step, unscale: StepUnscale | None):
        self._before_layer_step = before_layer_step
        self._unscale = unscale
        self._entries: list[tuple[list, list]] = []
        self._opened = False

    def add(self, params: list, grads: list) -> None:
        """One update this gate holds back: its parameters and the gradients it steps with."""
        self._entries.append((params, grads))

    def open(self) -> None:
        """Reduce and check every held update's gradients (once; an error fails the step here)."""
        if self._opened:
            return
        self._opened = True
        for params, grads in self._entries:
            if self._before_layer_step is not None:
                self._before_layer_step(params)
            if self._unscale is not None:
                self._unscale.unscale(grads)


def note_put_back(exc: BaseException, undo: StepUndo, restored, timeout_s: float) -> None:
    """After a failed step: wait for ``restored`` (the lane's putting back of ``undo``'s units) and add
    to ``exc`` what the step had updated and whether it is back."""
    try:
        restored.wait(timeout_s, waiter="restoring the failed step")
    except PipelineError as err:
        exc.add_note(f"the layers this step updated ({', '.join(undo.stepped) or 'none'}) could not be put back: "
                     f"{err}; restore the weights and optimizer state from a checkpoint before training on")
        return
    if undo.stepped:
        exc.add_note(failure_note(undo))


def layers_named(label: TaskLabel) -> str:
    """The layers an optimizer task's label names ("layer 3", "layers 2-4"), for messages."""
    stage = label.stage
    if stage.startswith("L") and "-" in stage:
        lo, hi = stage[1:].split("-")
        return f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"
    return stage or label.kind
