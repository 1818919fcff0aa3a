"""The split-invariance check: does every pipelined layer compute on microbatches what it computes whole?

The pipeline cuts each batch along dim 0, which is exact only for layers whose output rows depend
on their own input rows alone and whose state writes do not depend on the cut. Before the first
call in each training mode, the check runs the layers on the host, under no grad, on the rows of
the first two microbatches, whole and per microbatch, and compares outputs and kept state. It
refuses, naming the layer, one that differs or replaces a registered buffer in forward; random
state, buffers and attributes are put back. Priced by ``roundpipe_lab/analysis/split_check.py``. It runs in its own
thread under the run's ``timeout``: a layer call that hangs fails with ``PipelineTimeout`` naming
the layer. More: docs/design.md, design notes, ``engine/split_invariance.py``.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import ForwardHookError, SplitInvarianceError
from ..options import OptionError
from ..workers.completions import PipelineTimeout
from .microbatch import HostRows, batch_size_of, split_microbatches
from .rng import CPU_GENERATOR

MEASURED_FLOOR = 5.7e-7
"""The summation-order floor in fp32: ||split - whole|| / ||whole|| of a plain stack of 8 Linear+GELU
layers (width 1024, 32 rows cut in 4), the worst seen on this project's CPU host
(``tests/engine/test_split_invariance.py::test_linear_stack_floor`` measures it again)."""

FLOOR_MULTIPLE = 200
"""Outputs may differ by this many floors (1.1e-4 in fp32) before a layer is refused; the layers the
check exists for differ by 1e-2 to 1."""

PLAIN_TYPES = (bool, int, float, str, type(None))


LAYER_MARK = "split_check_layer"
"""The attribute ``_host_call`` puts on an error a layer raised on the host: the layer's index."""


def _host_call(index: int, layer: nn.Module, carry: Any) -> Any:
    # each call gets its own copy of its input: a layer that writes its input in place (``x.mul_``, ReLU(inplace))
    # would otherwise change the caller's batch and the carry the next call (whole or split) reads
    carry = pytree.tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, carry)
    try:
        return layer(carry)
    except ForwardHookError:  # a refusal of its own (a hook keeping outputs): raised as it is
        raise
    except Exception as err:  # noqa: BLE001 - reported by SplitInvarianceCheck.run, which then skips the check
        setattr(err, LAYER_MARK, index)
        raise


def tolerance(dtype: torch.dtype) -> float:
    """The relative difference allowed between whole and split outputs of ``dtype``."""
    scale = torch.finfo(dtype).eps / torch.finfo(torch.float32).eps
    return min(FLOOR_MULTIPLE * MEASURED_FLOOR * scale, 0.05)


@dataclass
class CheckReport:
    """What one run of the check saw: seconds on the host, rows checked, layers that draw random numbers
    (their outputs cannot be compared) and the layers found split-invariant, state writes included."""

    seconds: float = 0.0
    rows: int = 0
    random_layers: list = field(default_factory=list)
    verified: list = field(default_factory=list)


def _first_rows(tree: Any, rows: int) -> Any:
    """``tree`` with every batch leaf cut to its first ``rows`` rows."""
    def cut(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf[:rows]
        if isinstance(leaf, HostRows):
            return HostRows(leaf.rows[:rows])
        return leaf
    return pytree.tree_map(cut, tree, is_leaf=lambda x: isinstance(x, HostRows))


class _State:
    """The state of a layer: per submodule, its buffers (object, value copy), tensor attributes and plain
    attributes. ``restore`` puts objects and values back and drops attributes added since."""

    def __init__(self, layer: nn.Module):
        self.modules = list(layer.named_modules())
        self.buffers = {}
        self.attrs = {}
        self.none_buffers = {name: {k for k, b in m._buffers.items() if b is None} for name, m in self.modules}
        for name, m in self.modules:
            for key, b in m._buffers.items():
                if b is not None:
                    self.buffers[(name, key)] = (b, _Saved(b))
            self.attrs[name] = {k: (v, _Saved(v) if isinstance(v, torch.Tensor) else v)
                                for k, v in vars(m).items() if _is_state_attribute(k, v)}

    def changes(self) -> tuple[dict, list]:
        """(the state values now, keyed by a readable path; the paths of buffers replaced by another object)."""
        now, replaced = {}, []
        for name, m in self.modules:
            for key, b in m._buffers.items():
                path = f"{name}.{key}" if name else key
                before = self.buffers.get((name, key))
                if before is not None and b is not before[0]:
                    replaced.append(path)
                now[path] = b.detach().clone() if isinstance(b, torch.Tensor) else b
            for k, v in vars(m).items():
                if _is_state_attribute(k, v):
                    now[f"{name}.{k}" if name else k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        return now, replaced

    def restore(self) -> None:
        for (name, key), (obj, value) in self.buffers.items():
            m = dict(self.modules)[name]
            if key in m._buffers or key not in m._parameters:
                m._buffers[key] = obj
            value.put_back(obj)
        for name, m in self.modules:
            for key in [k for k in m._buffers if (name, k) not in self.buffers and m._buffers[k] is not None]:
                if key in self.none_buffers[name]:
                    m._buffers[key] = None
                else:
                    del m._buffers[key]  # registered by the forward the check ran
            saved = self.attrs[name]
            for k in [k for k, v in vars(m).items() if _is_state_attribute(k, v) and k not in saved]:
                delattr(m, k)
            for k, (obj, value) in saved.items():
                if isinstance(obj, torch.Tensor):
                    value.put_back(obj)
                object.__setattr__(m, k, obj)


class _Saved:
    """A tensor's value and version counter; ``put_back`` copies the value back only if the tensor was written
    since, so a buffer the forward only read keeps its version (a graph recorded before the check, that saved
    it for backward, e.g. Gemma's ``embed_scale``, still backpropagates). Written means a moved version counter
    or a changed value: some kernels write without bumping the counter (BatchNorm's running statistics)."""

    def __init__(self, tensor: torch.Tensor):
        self.value = tensor.detach().clone()
        self.version = _version_of(tensor)

    def put_back(self, tensor: torch.Tensor) -> None:
        if self.version is None or _version_of(tensor) != self.version or not _same_bits(tensor, self.value):
            with torch.no_grad():
                tensor.copy_(self.value)
            self.version = _version_of(tensor)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values, NaNs in the same places counting as equal."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place write); None for an inference tensor, which has none."""
    return None if tensor.is_inference() else tensor._version


def _is_state_attribute(key: str, value: Any) -> bool:
    if key in ("training", "forward") or key.startswith("__"):
        return False
    if isinstance(value, torch.Tensor):
        return not isinstance(value, nn.Parameter)
    return isinstance(value, PLAIN_TYPES)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not (a.is_floating_point() or a.is_complex()):
        return 0.0 if torch.equal(a, b) else float("inf")
    a, b = a.double(), b.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return 0.0 if torch.equal(a.nan_to_num(), b.nan_to_num()) else float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _as_split(whole: Any, parts: list) -> tuple[list, list]:
    """Leaf by leaf: the whole run's leaf and what the split runs give for it (concatenated rows; for a leaf of
    the whole's shape, each microbatch's own copy, or their sum: a loss sum, router statistics), as (pairs to
    compare, leaf kinds). A leaf that is a tensor in some runs and None in others is not compared: the outputs of
    the layers that read it are."""
    wl, spec = pytree.tree_flatten(whole)
    pl = [pytree.tree_flatten(p) for p in parts]
    if any(s != spec for _, s in pl):
        return [("structure", 1.0, 0.0)], []
    pairs, kinds = [], []
    for i, w in enumerate(wl):
        ps = [p[0][i] for p in pl]
        runs = [w, *ps]
        if all(v is None or isinstance(v, torch.Tensor) for v in runs) and any(v is None for v in runs) and \
                any(isinstance(v, torch.Tensor) for v in runs):
            # an optional tensor some calls leave out (HF builds no mask for rows without padding): it is the
            # layer's choice of representation, not a value to compare; the layers reading it are checked next
            kinds.append("same")
            continue
        if not isinstance(w, torch.Tensor):  # plain values must agree; opaque objects are not compared
            same = all(p is w or not isinstance(w, PLAIN_TYPES) or (type(p) is type(w) and p == w) for p in ps)
            kinds.append("same")
            pairs.append((f"leaf {i}", 0.0 if same else float("inf"), 0.0))
            continue
        if w.dim() > 0 and all(isinstance(p, torch.Tensor) and p.dim() == w.dim() and p.shape[1:] == w.shape[1:]
                               for p in ps) and sum(p.shape[0] for p in ps) == w.shape[0] and len(ps) > 1:
            kinds.append("rows")
            pairs.append((f"leaf {i}", _rel(torch.cat(ps), w), tolerance(w.dtype) if w.is_floating_point() else 0.0))
        elif all(isinstance(p, torch.Tensor) and p.shape == w.shape for p in ps):
            kinds.append("same")
            err = max(_rel(p, w) for p in ps)
            if err > 0:  # additive statistics (a loss sum, router counts): the microbatches' values add up
                err = min(err, _rel(torch.stack(ps).sum(0), w))
            pairs.append((f"leaf {i}", err, tolerance(w.dtype) if w.is_floating_point() else 0.0))
        else:
            kinds.append("same")
            pairs.append((f"leaf {i}", float("inf"), 0.0))
    return pairs, kinds


def _resync(whole: Any, parts: list, kinds: list) -> list:
    """The microbatch carries cut from the whole run's output, so every layer is compared on identical inputs
    (differences neither add up over layers nor follow a layer that draws random numbers)."""
    wl, spec = pytree.tree_flatten(whole)
    pl = [pytree.tree_flatten(p)[0] for p in parts]
    out = []
    start = [0] * len(wl)
    for leaves in pl:
        new = []
        for i, (w, p) in enumerate(zip(wl, leaves)):
            if kinds and kinds[i] == "rows":
                n = p.shape[0]
                new.append(w[start[i]:start[i] + n])
                start[i] += n
            else:
                new.append(p)
        out.append(pytree.tree_unflatten(new, spec))
    return out


def _describe(layer: nn.Module, index: int, names: dict) -> str:
    """"pipelined layer i (`its path in the model`, its class)": the path of the layer, else of its outermost
    submodule the model holds (an adapter's wrapper is not in the model; the block it wraps is)."""
    for _, m in layer.named_modules():
        if id(m) in names:
            return f"pipelined layer {index} (`{names[id(m)]}`, {type(m).__name__})"
    return f"pipelined layer {index} ({type(layer).__name__})"


def _state_path(layer: nn.Module, path: str, names: dict) -> str:
    """A state path inside ``layer`` as the model spells it (``model.rotary_emb.inv_freq``) where it can."""
    owner, _, key = path.rpartition(".")
    try:
        module = layer.get_submodule(owner) if owner else layer
    except AttributeError:
        return path
    return f"{names[id(module)]}.{key}" if names.get(id(module)) else path


class SplitInvarianceCheck:
    """Runs the check once per training mode of the layers (``run``); ``skip``: layers the user accepted
    per-microbatch semantics for (``batch_statistics='per_microbatch'``)."""

    def __init__(self, layers: list[nn.Module], owner: str, root: nn.Module | None = None, skip=(), hint=None):
        self.layers = layers
        self.owner = owner
        self.root = root
        self.skip = set(skip)
        self.hint = hint  # layer module -> an extra sentence for a refusal (e.g. a family's dynamic RoPE), or None
        self.checked: set = set()  # the layers' training flags (a tuple) of each mode checked
        self.last: CheckReport | None = None
        self.running: tuple[int, str] | None = None  # the layer call under way (index, which call), for a timeout

    def run(self, inputs: Any, microbatches: int, timeout_s: float | None = None) -> CheckReport | None:
        """Check ``inputs`` cut into ``microbatches``; raise ``SplitInvarianceError`` naming the first layer that
        differs. Returns what was seen (None when this training mode was checked already). With ``timeout_s``,
        a layer call that takes longer raises ``PipelineTimeout`` naming it (see the module doc)."""
        if timeout_s is None:
            return self._check(inputs, microbatches)
        outcome: dict[str, Any] = {}

        def check() -> None:
            try:
                outcome["report"] = self._check(inputs, microbatches)
            except BaseException as err:  # noqa: BLE001 - raised again by the caller's thread below
                outcome["error"] = err

        self.running = None
        thread = threading.Thread(target=check, name="roundpipe-split-check", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            index, call = self.running or (0, "first")
            raise PipelineTimeout(
                f"{self.owner}(split_check=True): {_describe(self.layers[index], index, self._names())} did not "
                f"return within {timeout_s:g}s from its {call} call on the host (the split-invariance check runs "
                "every layer on the first batch's rows before the first step; nothing ran on the workers and the "
                "weights are as they were). If the layer is only slow on the host, raise timeout; "
                "split_check=False skips the check (its exactness is then not checked).")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["report"]

    def _names(self) -> dict:
        return {id(mod): n for n, mod in (self.root.named_modules() if self.root is not None else [])}

    def _check(self, inputs: Any, microbatches: int) -> CheckReport | None:
        key = tuple(layer.training for layer in self.layers)
        if key in self.checked:
            return None
        started = time.perf_counter()
        try:
            total = batch_size_of(inputs)
        except Exception:  # noqa: BLE001 - the engine's split says what is wrong with the batch
            return None
        m = min(microbatches, total)
        names = self._names()
        try:
            if m > 1:
                report = self._run(inputs, sum(batch_size_of(p) for p in split_microbatches(inputs, m)[:2]), m, names)
            else:  # nothing is cut: only a buffer replaced in forward can go wrong, and two rows show it
                try:
                    report = self._run(inputs, min(total, 2), m, names)
                except Exception as err:  # noqa: BLE001 - a layer that needs the whole batch (its size written in)
                    if not hasattr(err, LAYER_MARK):
                        raise
                    report = self._run(inputs, total, m, names)
        except Exception as err:  # noqa: BLE001 - a layer that only runs on the device (a CUDA-only kernel)
            if not hasattr(err, LAYER_MARK):
                raise
            self.checked.add(key)
            layer = getattr(err, LAYER_MARK)
            warnings.warn(f"{self.owner}(split_check=True): {_describe(self.layers[layer], layer, names)} "
                          f"cannot run on the host ({type(err).__name__}: {err}), so the split-invariance check was "
                          "skipped; the run goes on unchecked (split_check=False silences this)", stacklevel=3)
            return None
        self.checked.add(key)
        report.seconds = time.perf_counter() - started
        self.last = report
        return report

    def _run(self, inputs: Any, rows: int, m: int, names: dict) -> CheckReport:
        """Every layer in turn on the first ``rows`` rows of ``inputs``, whole and (``m`` > 1) as two microbatches."""
        whole = _first_rows(inputs, rows)
        parts = split_microbatches(whole, 2) if m > 1 else []
        report = CheckReport(rows=rows)
        # fp32 on the host whatever the caller's autocast: split invariance is the layer's arithmetic, and bf16's
        # own rounding would hide behind (or fake) a difference. The check sets torch's CPU generator back and
        # forth, so it holds it alone: another fit's pipelined layers in this process must not see it move.
        with CPU_GENERATOR.exclusive("the split-invariance check"), torch.random.fork_rng(devices=[]), \
                torch.no_grad(), torch.autocast("cpu", enabled=False):
            for i, layer in enumerate(self.layers):
                whole, parts = self._layer(i, layer, whole, parts, m, names, report)
        return report

    def _layer(self, i, layer, whole, parts, m, names, report):
        state = _State(layer)
        rng = torch.get_rng_state()
        self.running = (i, "whole-batch")
        try:
            whole_out = _host_call(i, layer, whole)
            draws = not torch.equal(rng, torch.get_rng_state())
            after_whole, replaced = state.changes()
        finally:
            state.restore()
            torch.set_rng_state(rng)
        if replaced and i not in self.skip:
            self._refuse(i, names, f"replaces its buffer{'s' if len(replaced) > 1 else ''} "
                         f"{', '.join(_state_path(layer, p, names) for p in replaced)} in forward with new tensors; on a worker the replacement stays on "
                         "the worker's copy and never reaches the host, so later microbatches, the recompute in "
                         "backward and the next steps read the old values", what_to_do=("keep",))
        if not parts:
            return whole_out, parts
        try:
            split_out = []
            for k, part in enumerate(parts):
                self.running = (i, f"microbatch {k + 1} of {len(parts)}")
                split_out.append(_host_call(i, layer, part))
            after_split, _ = state.changes()
        finally:
            state.restore()
            torch.set_rng_state(rng)
        if draws:
            report.random_layers.append(i)
        pairs, kinds = _as_split(whole_out, split_out)
        if i not in self.skip:
            differing = [p for p in sorted(set(after_whole) | set(after_split))
                         if not _equal_state(after_whole.get(p), after_split.get(p), _tol_of(after_whole.get(p)))]
            state_text = (f"changes its state in forward ({', '.join(_state_path(layer, p, names) for p in differing)}) "
                          f"differently when called once per microbatch ({len(parts)} calls) than once on their rows "
                          "whole (a counter, statistics or an iteration run per call)")
            worst = max(((err, tol) for _, err, tol in pairs if err > tol), default=None) if not draws else None
            if worst is not None:
                err, tol = worst
                self._refuse(i, names, f"computes a different output on the {m} microbatches the batch is cut "
                             f"into (along dim 0) than on the whole batch: relative difference {err:.3g} "
                             f"(tolerance {tol:.2g}, {FLOOR_MULTIPLE}x the fp32 summation-order floor): one "
                             "sample's output depends on the other samples (a batch-coupled layer), or dim 0 of its "
                             "input is not the batch" + (f"; it also {state_text}" if differing else ""),
                             what_to_do=("microbatches", "batch_dim", "module"))
            if differing:
                self._refuse(i, names, state_text, what_to_do=("microbatches", "module"))
            report.verified.append(i)
        return whole_out, _resync(whole_out, split_out, kinds)

    def _refuse(self, i, names, what: str, what_to_do) -> None:
        advice = {
            "microbatches": "use microbatches=1 (the whole batch runs as one microbatch, exact)",
            "batch_dim": "put the batch in dim 0 of every input of the pipelined module (the pipeline cuts along dim 0)",
            "module": "pipeline a module without this layer (module='...'), so that it runs whole on the host",
            "keep": "compute that state once before training instead of in forward, or pipeline a module without "
                    "this layer (module='...')",
        }
        steps = [advice[w] for w in what_to_do]
        if "microbatches" in what_to_do:
            steps.append("for BatchNorm and InstanceNorm, batch_statistics='per_microbatch' accepts GPipe's "
                         "per-microbatch statistics (inexact)")
        extra = self.hint(self.layers[i]) if self.hint is not None else None
        raise SplitInvarianceError(
            f"{self.owner}(split_check=True): {_describe(self.layers[i], i, names)} {what}. "
            + (f"{extra} " if extra else "")
            + f"To train exactly: {'; or '.join(steps)}. split_check=False runs it anyway (NOT exact). "
            "Nothing ran: the weights are as they were.")


def _tol_of(value: Any) -> float:
    return tolerance(value.dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else 0.0


def _equal_state(a: Any, b: Any, tol: float) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _rel(a, b) <= tol
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b
