"""Per-layer random seeds, so that recompute reproduces the forward's random numbers exactly.

Every layer of every microbatch runs with its device's generator seeded to its own seed,
derived from one base seed per pipelined call, and restored afterwards: dropout, Mixtral's
router jitter, sampled routing, any ``torch.rand*``/``randn``/``multinomial`` call get the same
numbers in forward and in recompute, and the same seed gives the same run whatever the timing
(forward and backward stages may be cut differently, so seeding per stage would not do). No
layer has to be recognised as random.

The caller's random stream: the base seed is what one draw from the caller's CPU generator
would give, but it is only *peeked*; the draw is made (the stream advanced by it) once the
call's forward is over and only if some layer actually drew random numbers. A run whose layers
draw nothing leaves the caller's stream exactly as a plain run would; one with dropout leaves
it where earlier versions of this engine did (one draw per call).

On the CPU backend all workers share the process's CPU generator, so each layer runs under a
process-wide lock (the workers' layer math serialises; their transfers and injected delays
still overlap: the documented cost of exact randomness on CPU). On CUDA each worker has its
own device generator and nothing serialises.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

_CPU_RNG_LOCK = threading.RLock()
_MASK = (1 << 63) - 1


def layer_seed(base_seed: int, layer: int, microbatch: int) -> int:
    """Deterministic seed of one layer for one microbatch (splitmix64-style mixing)."""
    x = (base_seed * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + microbatch * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 29
    return x


def uses_randomness(module: nn.Module) -> bool:
    for m in module.modules():
        if not m.training:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for name, value in vars(m).items():
            if "dropout" in name and isinstance(value, float) and value > 0:
                return True
    return False


@contextlib.contextmanager
def seeded(device: torch.device, seed: int | None):
    """Run the block with the device's generator seeded to ``seed``; restore it afterwards."""
    if seed is None:
        yield
        return
    if device.type == "cuda":
        gen = torch.cuda.default_generators[device.index or 0]
        state = gen.get_state()
        gen.manual_seed(seed)
        try:
            yield
        finally:
            gen.set_state(state)
        return
    with _CPU_RNG_LOCK:
        state = torch.get_rng_state()
        torch.default_generator.manual_seed(seed)
        try:
            yield
        finally:
            torch.set_rng_state(state)


def _peek_base_seed() -> int:
    """What ``torch.randint(0, 2**62, ())`` on the caller's CPU generator gives, without drawing it."""
    g = torch.Generator()
    with _CPU_RNG_LOCK:
        g.set_state(torch.get_rng_state())
    return int(torch.randint(0, 2**62, (), generator=g).item())


class CallRng:
    """The random numbers of one pipelined call: a seed per (layer, microbatch)."""

    def __init__(self):
        self.base_seed = _peek_base_seed()
        self.drew = False
        self._advanced = False

    @contextlib.contextmanager
    def layer(self, device: torch.device, layer: int, microbatch: int):
        """Run one layer with its own seed; note whether it drew random numbers."""
        seed = layer_seed(self.base_seed, layer, microbatch)
        if device.type == "cuda":
            gen = torch.cuda.default_generators[device.index or 0]
            state = gen.get_state()
            gen.manual_seed(seed)
            offset = gen.get_offset()
            try:
                yield
            finally:
                self.drew = self.drew or gen.get_offset() != offset
                gen.set_state(state)
            return
        with _CPU_RNG_LOCK:
            state = torch.get_rng_state()
            torch.default_generator.manual_seed(seed)
            seeded_state = torch.get_rng_state()
            try:
                yield
            finally:
                self.drew = self.drew or not torch.equal(torch.get_rng_state(), seeded_state)
                torch.set_rng_state(state)

    def finish_forward(self) -> None:
        """After the call's forward: advance the caller's stream by the peeked draw if a layer drew."""
        if self.drew and not self._advanced:
            self._advanced = True
            with _CPU_RNG_LOCK:
                torch.randint(0, 2**62, ())
