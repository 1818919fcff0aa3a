"""Per-layer random seeds, so that recompute reproduces the forward's random numbers exactly.

Every layer of every microbatch that draws runs with its device's generator seeded to its own
seed (from one base seed per pipelined call) and restored afterwards, so forward and recompute
draw the same numbers whatever the timing, without recognising random layers. A gate gives a
seeded layer its generator alone; layers known not to draw share it, and a run of them is
checked once. An unseeded draw (another thread's, a layer that starts drawing) is never used:
the call fails with ``UnseededDraw``. Why each rule, and the waits: docs/design.md, design
notes, ``engine/rng.py``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..errors import PipelineTimeout, UnseededDraw
from ..host.compile_clock import COMPILE_CLOCK

_MASK = (1 << 63) - 1


def _state_bytes(state: torch.Tensor) -> bytes:
    """A generator state (a CPU uint8 tensor) as bytes: compared at the end of every shared layer call,
    where ``torch.equal`` took 4 us and this 1-2 us (``docs/measurements.md`` section 13)."""
    return state.numpy().tobytes()


def layer_seed(base_seed: int, layer: int, microbatch: int) -> int:
    """Deterministic seed of one layer for one microbatch (splitmix64-style mixing)."""
    x = (base_seed * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + microbatch * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 29
    return x


def uses_randomness(module: nn.Module) -> bool:
    """Whether a module in training mode below ``module`` may draw random numbers (dropout and the like)."""
    for m in module.modules():
        if not m.training:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for name, value in vars(m).items():
            if "dropout" in name and isinstance(value, float) and value > 0:
                return True
    return False


DEFAULT_GATE_TIMEOUT_S = 300.0  # the pool's default; a call passes its pool's timeout


@dataclass(eq=False)
class GeneratorHold:
    """One holder of the gate: what it runs (a ``(layer, microbatch, name)`` tuple or a text), its
    thread, the pool whose task it runs (``owner``, None on the host thread), ``where`` (a text
    naming that task, computed when an error needs it) and, exclusive holders only, the
    generator state it found (``saved``), which the gate puts back if the hold is abandoned."""

    what: object
    thread: threading.Thread
    owner: object = None
    where: Callable[[], str] | None = None
    saved: torch.Tensor | None = None
    abandoned: bool = False

    def describe(self) -> str:
        """What holds the generator and where, for timeout messages."""
        text = _describe(self.what) if isinstance(self.what, tuple) else str(self.what)
        where = self.where() if self.where is not None else f"thread {self.thread.name}"
        return f"{text} ({where})" if where else text


class CpuGeneratorGate:
    """A reader-writer lock over torch's default CPU generator, with a check on the shared side
    (or over another generator: ``get_state``/``set_state`` are its own, ``name`` says which in errors).

    ``exclusive()``: one holder (re-entrant on its thread), which may seed and draw. Waiting
    exclusive requests go before new shared ones, so a seeded layer is not starved.
    ``enter_shared``/``exit_shared``: any number of holders, none of which may draw; each exit
    compares the generator with the state the shared period began with.

    Every wait is bounded (``PipelineTimeout`` naming the waiter and the holders). A pool
    shut down with a lane still inside a layer (after a timeout: Python cannot stop the thread)
    gives up its holds with ``abandon``, so that a new call does not wait for that thread:
    the gate puts back the generator state the holder found, and the thread's own exit, whenever
    it comes, changes nothing.
    """

    def __init__(self, get_state: Callable[[], torch.Tensor] = torch.get_rng_state,
                 set_state: Callable[[torch.Tensor], None] = torch.set_rng_state,
                 name: str = "torch's CPU generator") -> None:
        self._get_state, self._set_state, self.name = get_state, set_state, name
        self._cond = threading.Condition(threading.Lock())
        self._exclusive: GeneratorHold | None = None
        self._depth = 0
        self._waiting = 0  # exclusive requests waiting
        self._shared: dict[object, GeneratorHold] = {}  # token -> holder inside
        self._expected: bytes | None = None  # the generator's state while shared holders run (its bytes)
        self._tainted: dict[object, list] = {}  # token -> who was inside when a change was seen

    def _put_back_expected(self) -> None:
        self._set_state(torch.frombuffer(bytearray(self._expected), dtype=torch.uint8))

    def held_here(self) -> bool:
        """Whether this thread holds the gate exclusively (a call nested in a seeded one)."""
        hold = self._exclusive
        return hold is not None and hold.thread is threading.current_thread()

    def _wait_until(self, free: Callable[[], bool], timeout: float, waiter: GeneratorHold) -> None:
        """Wait on the condition (its lock held) until ``free()``; raise a timeout naming who holds it."""
        deadline = time.monotonic() + timeout
        while not free():
            left = deadline + COMPILE_CLOCK.seconds_between(deadline - timeout) - time.monotonic()
            if left <= 0:
                holders = ([self._exclusive] if self._exclusive is not None else []) + list(self._shared.values())
                held = "; ".join(h.describe() for h in holders)
                if self._waiting and self._exclusive is None:
                    held = (held + "; " if held else "") + f"{self._waiting} seeded call(s) waiting to go first"
                raise PipelineTimeout(
                    f"{waiter.describe()} timed out after {timeout:g}s waiting for {self.name}, held by "
                    f"{held or 'nobody'}. A layer that may draw random numbers has its generator to itself (on the CPU "
                    "backend the process's, on a GPU the device's, shared by the workers on that device); the "
                    "holder did not return (a hung layer?)")
            self._cond.wait(left)

    @contextlib.contextmanager
    def exclusive(self, what: object = "the host thread", timeout: float = DEFAULT_GATE_TIMEOUT_S, owner: object = None,
                  where: Callable[[], str] | None = None):
        """Hold the generator alone; yields the ``GeneratorHold`` (the same one when nested)."""
        me = threading.current_thread()
        with self._cond:
            hold = self._exclusive
            if hold is not None and hold.thread is me:
                self._depth += 1
            else:
                if any(h.thread is me for h in self._shared.values()):
                    raise RuntimeError(f"a thread inside a shared layer call asked for {self.name} exclusively")
                hold = GeneratorHold(what, me, owner, where)
                self._waiting += 1
                try:
                    self._wait_until(lambda: self._exclusive is None and not self._shared, timeout, hold)
                finally:
                    self._waiting -= 1
                    if self._exclusive is not None or self._shared:
                        self._cond.notify_all()  # a timed-out request no longer keeps shared ones out
                self._exclusive, self._depth = hold, 1
        try:
            yield hold
        finally:
            with self._cond:
                if self._exclusive is hold:  # not abandoned meanwhile
                    self._depth -= 1
                    if self._depth == 0:
                        self._exclusive = None
                        self._cond.notify_all()

    def put_back(self, hold: GeneratorHold, state: torch.Tensor) -> bool:
        """Set the generator to ``state`` unless ``hold`` was abandoned (then the gate did, and the
        generator may be another call's by now); return whether it did."""
        with self._cond:
            if hold.abandoned:
                return False
            self._set_state(state)
            return True

    def enter_shared(self, what: tuple, timeout: float = DEFAULT_GATE_TIMEOUT_S, owner: object = None,
                     where: Callable[[], str] | None = None) -> object:
        """Enter a shared (non-drawing) period for ``what``; returns the token ``exit_shared`` takes. Waits up
        to ``timeout`` for an exclusive holder."""
        token, me = object(), threading.current_thread()
        with self._cond:
            hold = GeneratorHold(what, me, owner, where)
            nested = any(h.thread is me for h in self._shared.values())  # never waits on itself
            if not nested:
                self._wait_until(lambda: self._exclusive is None and not self._waiting, timeout, hold)
            if not self._shared:
                self._expected = _state_bytes(self._get_state())
            self._shared[token] = hold
        return token

    def exit_shared(self, token: object) -> list:
        """Leave; return what ran alongside an unseeded draw seen while this holder was inside ([] if
        none, and for an abandoned holder: the gate checked and put back its period when it abandoned it)."""
        with self._cond:
            if token not in self._shared:
                return []
            if _state_bytes(self._get_state()) != self._expected:
                inside = [h.what for h in self._shared.values()]
                for t in self._shared:
                    self._tainted.setdefault(t, inside)
                self._put_back_expected()  # the draw is not used; the next check starts clean
            del self._shared[token]
            seen = self._tainted.pop(token, [])
            if not self._shared:
                self._expected = None
                self._cond.notify_all()
            return seen

    def abandon(self, owner: object) -> list[str]:
        """Give up every hold of ``owner``'s tasks (a pool shut down with lanes stuck inside a layer):
        put back the generator state they found, wake the waiters; return who they were."""
        if owner is None:
            return []
        with self._cond:
            gone = []
            hold = self._exclusive
            if hold is not None and hold.owner is owner:
                hold.abandoned = True
                if hold.saved is not None:
                    self._set_state(hold.saved)
                self._exclusive, self._depth = None, 0
                gone.append(hold)
            for token, h in list(self._shared.items()):
                if h.owner is owner:
                    h.abandoned = True
                    del self._shared[token]
                    self._tainted.pop(token, None)
                    gone.append(h)
            if gone and not self._shared and self._expected is not None:
                self._put_back_expected()  # what the shared period began with: a draw in it is not kept
                self._expected = None
            if gone:
                self._cond.notify_all()
            return [h.describe() for h in gone]


CPU_GENERATOR = CpuGeneratorGate()


def cuda_generator(device: torch.device):
    """The default generator of CUDA ``device`` (what dropout on that device draws from)."""
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


_DEVICE_GATES: dict[int, CpuGeneratorGate] = {}
_DEVICE_GATES_LOCK = threading.Lock()


def device_generator_gate(device: torch.device) -> CpuGeneratorGate:
    """The gate over CUDA ``device``'s generator, one per device index, shared by every worker on it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    gate = _DEVICE_GATES.get(index)  # around every layer call: the lock only to create it
    if gate is not None:
        return gate
    with _DEVICE_GATES_LOCK:
        gate = _DEVICE_GATES.get(index)
        if gate is None:
            dev = torch.device("cuda", index)  # the generator is looked up at each use, never kept
            gate = CpuGeneratorGate(lambda: cuda_generator(dev).get_state(),
                                    lambda state: cuda_generator(dev).set_state(state), f"the generator of cuda:{index}")
            _DEVICE_GATES[index] = gate
    return gate


def abandon_generators(owner: object) -> list[str]:
    """Give up ``owner``'s holds of every generator gate (the CPU one and each device's); who they were."""
    with _DEVICE_GATES_LOCK:
        gates = [CPU_GENERATOR, *_DEVICE_GATES.values()]
    return [who for gate in gates for who in gate.abandon(owner)]


class LayerDraws:
    """What is known of each layer module, per training flags: draws (True), draws nothing (False).

    Keyed weakly by the module object, so the knowledge lasts as long as the layer does and is
    shared by every engine running it."""

    def __init__(self) -> None:
        self._known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def known(self, module: nn.Module, flags: tuple) -> bool | None:
        """Whether ``module`` was seen to draw with these ``flags`` (None: not seen yet)."""
        with self._lock:
            return self._known.get(module, {}).get(flags)

    def note(self, module: nn.Module, flags: tuple, draws: bool) -> None:
        """Record whether ``module`` drew with these ``flags``; once seen drawing, it stays drawing."""
        with self._lock:
            per_flags = self._known.setdefault(module, {})
            if not per_flags.get(flags):  # once seen to draw, a layer stays drawing
                per_flags[flags] = draws


LAYER_DRAWS = LayerDraws()


def _peek_base_seed(timeout: float) -> int:
    """What ``torch.randint(0, 2**62, ())`` on the caller's CPU generator gives, without drawing it."""
    g = torch.Generator()
    with CPU_GENERATOR.exclusive("the host thread, peeking a new call's seed", timeout):
        g.set_state(torch.get_rng_state())
    return int(torch.randint(0, 2**62, (), generator=g).item())


def _describe(what: tuple) -> str:
    layer, microbatch, name = what
    if isinstance(layer, range):  # a run of layers checked as one (``CallRng.quiet_run``)
        return f"layers {layer.start}-{layer.stop - 1} ({name}), microbatch {microbatch}"
    return f"layer {layer} ({name}), microbatch {microbatch}"


class CallRng:
    """The random numbers of one pipelined call: a seed per (layer, microbatch)."""

    def __init__(self, draws: LayerDraws = LAYER_DRAWS, *, timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
                 owner: object = None, task_of: Callable[[threading.Thread], str] | None = None):
        """``timeout_s`` bounds every wait for the CPU generator; ``owner`` (the worker pool) is
        what ``CpuGeneratorGate.abandon`` names; ``task_of(thread)`` names the task a thread
        runs, for errors."""
        self.timeout_s, self.owner, self._task_of = timeout_s, owner, task_of
        self.base_seed = _peek_base_seed(timeout_s)
        self.drew = False
        self._advanced = False
        self._draws = draws
        # (layer, microbatch) -> where the forward's seeded draws left the generator (None: no draw)
        self._forward_ends: dict[tuple[int, int], int | None] = {}
        # id(layer module) -> (the module, every module below it): read once per call, since walking
        # ``modules()`` at every layer call took a quarter of a shared call
        self._submodules: dict[int, tuple[nn.Module, tuple[nn.Module, ...]]] = {}

    def _flags(self, module: nn.Module) -> tuple:
        """The training flags of every module below ``module`` (what decides whether it draws, the key of
        ``LayerDraws``), read at every call from the module tree read once per call."""
        entry = self._submodules.get(id(module))
        if entry is None or entry[0] is not module:
            entry = (module, tuple(module.modules()))
            self._submodules[id(module)] = entry  # two threads may both fill it: the same tree either way
        return tuple(m.training for m in entry[1])

    @staticmethod
    def _gate(device: torch.device) -> CpuGeneratorGate:
        """The gate over the generator a layer on ``device`` draws from: the device's on CUDA, else the CPU's."""
        return device_generator_gate(device) if device.type == "cuda" else CPU_GENERATOR

    def all_quiet(self, modules) -> bool | None:
        """Whether every one of ``modules`` (with its training flags now) is known not to draw: False once
        one is known to draw, True once all are known not to, else None (one has not run with these flags)."""
        known = [self._draws.known(m, self._flags(m)) for m in modules]
        if any(known):
            return False
        return None if any(k is None for k in known) else True

    @contextlib.contextmanager
    def quiet_run(self, device: torch.device, layers: range, microbatch: int, modules, recompute: bool = False):
        """Around a run of ``layers`` (``modules``) on one worker, when no layer of the call may draw (the
        caller checks ``all_quiet``): one shared period of the device's generator for the whole run,
        checked once at its end, instead of one per layer (a shared period's entry and exit cost 7-11 us
        of the GIL, around every layer call). Yields whether it holds that period; when it does, each
        layer runs without ``layer``. A change of the generator seen at the end fails the call as a
        shared layer's does, and marks every layer of the run as drawing."""
        gate = self._gate(device)
        if len(layers) < 2 or gate.held_here():
            yield False
            return
        names = ", ".join(dict.fromkeys(type(m).__name__ for m in modules))  # in layer order, each once
        token = gate.enter_shared((layers, microbatch, names), self.timeout_s, self.owner, self._where())
        try:
            yield True
        finally:
            seen = gate.exit_shared(token)
        if seen:
            for m in modules[1:]:
                self._draws.note(m, self._flags(m), True)
            self._unseeded_draw((layers, microbatch, names), modules[0], self._flags(modules[0]), seen)
        for layer, module in zip(layers, modules):
            self._check_end((layer, microbatch), None, recompute, module)

    @contextlib.contextmanager
    def layer(self, device: torch.device, layer: int, microbatch: int, module: nn.Module | None = None,
              recompute: bool = False):
        """Run one layer; seeded when it may draw, and never with an unseeded draw (see the module doc).

        ``module`` is the layer (without it the call always runs seeded); ``recompute``: this call
        recomputes one the forward made, and must draw what it drew."""
        seed = layer_seed(self.base_seed, layer, microbatch)
        flags = None if module is None else self._flags(module)
        gate = self._gate(device)
        if module is not None and self._draws.known(module, flags) is False and not gate.held_here():
            # Shared (inlined rather than a nested context manager: this runs around every layer call)
            token = gate.enter_shared((layer, microbatch, type(module).__name__), self.timeout_s, self.owner,
                                      self._where())
            try:
                yield
            finally:
                seen = gate.exit_shared(token)
            if seen:
                self._unseeded_draw((layer, microbatch, type(module).__name__), module, flags, seen)
            self._check_end((layer, microbatch), None, recompute, module)
            return
        if device.type == "cuda":
            with self._device_layer(device, seed, (layer, microbatch, type(module).__name__ if module is not None
                                                   else "layer")) as drew:
                yield
            if module is not None and drew:  # known after the layer returned: a failed call teaches nothing
                self._draws.note(module, flags, drew[0] or uses_randomness(module))
            return
        what = (layer, microbatch, type(module).__name__ if module is not None else "layer")
        with CPU_GENERATOR.exclusive(what, self.timeout_s, self.owner, self._where()) as hold:
            state = torch.get_rng_state()
            if hold.saved is None:  # the outermost call of a nested hold: what abandoning it puts back
                hold.saved = state
            torch.default_generator.manual_seed(seed)
            seeded_state = torch.get_rng_state()
            try:
                yield
            finally:
                end = torch.get_rng_state()
                CPU_GENERATOR.put_back(hold, state)
            if hold.abandoned:
                return  # its pool was shut down while it ran: nothing it saw is known to be its own
            drew = not torch.equal(end, seeded_state)
            if drew:
                self.drew = True  # only ever set, and under the gate
        # Reached only when the layer returned: a failed call teaches nothing and is not compared.
        self._check_end((layer, microbatch), hash(end.numpy().tobytes()) if drew else None, recompute, module)
        if module is not None:
            self._draws.note(module, flags, drew or uses_randomness(module))

    @contextlib.contextmanager
    def _device_layer(self, device: torch.device, seed: int, what: tuple):
        """One layer on a CUDA device, seeded, holding the device's generator alone (see the module doc).
        Yields a list that holds, once the layer returned, whether it drew (empty if it raised or its
        hold was abandoned: nothing it saw is known to be its own)."""
        gen, gate = cuda_generator(device), device_generator_gate(device)
        outcome: list[bool] = []
        with gate.exclusive(what, self.timeout_s, self.owner, self._where()) as hold:
            state = gen.get_state()
            if hold.saved is None:  # the outermost call of a nested hold: what abandoning it puts back
                hold.saved = state
            gen.manual_seed(seed)
            offset = gen.get_offset()
            try:
                yield outcome
            finally:
                drew = gen.get_offset() != offset
                gate.put_back(hold, state)
            if not hold.abandoned:
                outcome.append(drew)
                if drew:
                    self.drew = True  # only ever set: workers running at once cannot undo each other's

    def _unseeded_draw(self, what: tuple, module: nn.Module, flags: tuple, seen: list):
        """A shared call saw the generator change (``seen``: who ran alongside): mark the layer drawing, fail.
        ``what``: (layer, microbatch, name), the layer a ``range`` for a quiet run (``module``: its first)."""
        self._draws.note(module, flags, True)
        one = not isinstance(what[0], range)
        raise UnseededDraw(
            f"torch's CPU generator changed while {_describe(what)} ran as {'a layer' if one else 'layers'} "
            "known not to draw random numbers (an earlier call with the same training flags drew "
            f"none); running at the same time: {'; '.join(_describe(w) for w in seen)}. Either one of these "
            "layers drew random numbers this time, or another thread drew from torch's default CPU generator "
            "while the pipeline ran (it must not). An unseeded draw cannot be reproduced in recompute, so the call "
            "fails rather than give a wrong gradient (a failed step puts back what it changed); these layers "
            "now run seeded, so running the step again is exact.")

    def _where(self) -> Callable[[], str] | None:
        """A text naming the task the calling thread runs, computed only if an error needs it."""
        if self._task_of is None:
            return None
        thread, task_of = threading.current_thread(), self._task_of
        return lambda: task_of(thread)

    def _check_end(self, key: tuple[int, int], end: int | None, recompute: bool, module: nn.Module | None) -> None:
        if not recompute:
            self._forward_ends[key] = end
            return
        if key in self._forward_ends and self._forward_ends[key] != end:
            raise UnseededDraw(
                f"{_describe((key[0], key[1], type(module).__name__ if module is not None else 'layer'))} drew "
                "different random numbers in recompute than in its forward, from the same seed: another thread "
                "drew from torch's default CPU generator while one of them ran, or the layer's draws depend on "
                "more than its input and seed. The gradient would not match the forward, so the call fails rather "
                "than give it (a failed step puts back what it changed).")

    def finish_forward(self) -> None:
        """After the call's forward: advance the caller's stream by the peeked draw if a layer drew."""
        if self.drew and not self._advanced:
            self._advanced = True
            with CPU_GENERATOR.exclusive("the host thread, advancing the caller's stream after a forward",
                                         self.timeout_s):
                torch.randint(0, 2**62, ())
