"""Per-layer random seeds, so that recompute reproduces the forward's dropout masks exactly.

Forward and backward stages may be cut differently, so seeding per stage would not do: each
layer of each microbatch gets its own seed, derived from one base seed drawn per forward call
(from the caller's global generator, so ``seed_everything`` makes runs repeatable). A layer is
seeded only when it uses randomness (a dropout module with p > 0 in training mode, or a
``*dropout*`` float attribute > 0 such as Hugging Face attention dropout); layers without it
never touch a generator, and the engine draws no base seed at all when no layer needs one,
so it leaves the caller's random stream exactly as a plain run would.

On the CPU backend all workers share the process's CPU generator, so a seeded layer runs
under a process-wide lock (workers serialise while they run random layers; documented cost).
On CUDA each worker has its own device generator.
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
