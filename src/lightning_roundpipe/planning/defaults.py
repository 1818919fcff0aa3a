"""The choices RoundPipe makes when the user leaves them open: recompute, microbatches, host work.

``recompute="auto"`` keeps the forward graphs (no recompute) on the CPU backend when they fit the
memory budget, else recomputes; ``microbatches=None`` takes the count the timing model predicts
fastest among 1, 2 and 4 per worker, the fewest within ``TIE_TOLERANCE`` of the fastest;
``estimate_host_work`` prices the host's work before it is measured. Why each: docs/design.md,
design notes, ``planning/defaults.py``; the user's view: docs/tuning.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from ..cost.profile import CostProfile
from ..cost.view import CostView
from .predictor import HostWork
from .search import TIE_TOLERANCE

MICROBATCHES_PER_WORKER = (1, 2, 4)  # the candidate counts, in workers
# Host costs of a caller's loss on the full output, measured on the 2-core development machine.
# F.cross_entropy forward + backward in isolation (one thread, fp32, 512 x 6144 logits on warm
# memory, best of 10) took 6.1 ns per output element. In the loss phase the tensors (merged
# logits, log-softmax, the logits' gradient) are fresh every step: with glibc's own thresholds
# each page faulted on first touch and the phase cost 12 ns per element (151.6 ms for 16 x 128 x
# 6144 logits). With freed memory kept for reuse (the CPU backend's ``cpu_reuse_freed_memory``,
# ``host/host_allocator.py``), the copy into the merged logits plus the loss took 60-81 ms on
# one thread (``python benchmarks/figures/host_allocator_faults.py``, 2026-12-02, load average 9
# from other jobs), about 5.5 ns per element: the estimate below. The phase measured 33 ms
# between forward and backward (the caller's two threads; ``python -m benchmarks.peers.out_of_box
# --bar``, load 6-9). A copy moved 24.5 GB/s (read + write). Used only until the host work is measured.
HOST_LOSS_SECONDS_PER_ELEMENT = 5.5e-9
HOST_COPY_BYTES_PER_SECOND = 24.5e9

def no_recompute_peak_bytes(costs: CostProfile, microbatches: int) -> int:
    """Device bytes a worker may need with recompute off: every layer's graph for all
    ``microbatches`` (the forward stages a worker ran keep theirs until their backward) plus
    the two largest layers' weights and weight gradients (the stage it runs and the one it prefetches)."""
    view = CostView(costs)
    states = sorted((c.held_weight_bytes + c.grad_bytes for c in costs.layers), reverse=True)
    return microbatches * view.graph(0, len(costs)) + sum(states[:2])


def host_memory_budget() -> int | None:
    """Half the host's physical memory (what ``recompute="auto"`` lets kept graphs use on the CPU
    backend when no budget is set); None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return None


def choose_recompute(setting: str, backend: str, costs: CostProfile, microbatches: int,
                     memory_budget_bytes: int | None) -> bool:
    """True to recompute. ``setting`` is "always", "never" or "auto" (see the module doc)."""
    if setting != "auto":
        return setting != "never"
    if backend != "cpu":
        return True  # graphs cannot stay on a GPU worker across the round-robin
    if memory_budget_bytes is None:
        return False
    return no_recompute_peak_bytes(costs, microbatches) > memory_budget_bytes


def rescaled(costs: CostProfile, tokens_per_microbatch: float) -> CostProfile:
    """``costs`` for microbatches of ``tokens_per_microbatch`` tokens (times scale with tokens)."""
    factor = tokens_per_microbatch / costs.tokens_per_microbatch
    return dataclasses.replace(costs, layers=[c.scaled(factor) for c in costs.layers],
                               tokens_per_microbatch=max(1, round(tokens_per_microbatch)))


def choose_microbatches(costs: CostProfile, num_workers: int, step_tokens: int,
                        predicted_step: Callable[[CostProfile, int], float], most: int | None = None) -> int:
    """The microbatch count for steps of ``step_tokens`` tokens (see the module doc).

    ``predicted_step(costs, microbatches)``: the predicted step of the plan the partition policy
    makes for those per-microbatch costs. ``most``: the batch's samples (no count above it; with
    fewer samples than workers, one microbatch per sample).
    """
    candidates = [k * num_workers for k in MICROBATCHES_PER_WORKER if most is None or k * num_workers <= most]
    if not candidates:
        return max(1, most)
    steps = {m: predicted_step(rescaled(costs, step_tokens / m), m) for m in candidates}
    fastest = min(steps.values())
    return min(m for m, s in steps.items() if s <= fastest * (1 + TIE_TOLERANCE))


def estimate_host_work(costs: CostProfile, microbatches: int, fused_last: bool) -> HostWork:
    """The host's work in the forward/backward barrier before it is measured: copying the last
    microbatch's output into its rows of the merged output (a copy: read and write; the host
    copies the earlier ones while the workers still compute, ``engine/microbatch.py``) and the
    caller's cross-entropy forward and backward on the whole output (``HOST_LOSS_SECONDS_PER_ELEMENT``,
    one thread's rate: what a busy host gives; the caller's threads are measured after the first
    step). A fused last stage computes the loss on the workers: nothing."""
    if fused_last:
        return HostWork()
    output_bytes = CostView(costs).out_bytes(len(costs) - 1) * microbatches
    elements = output_bytes / costs.dtype_bytes
    last_copy_s = 2 * output_bytes / max(1, microbatches) / HOST_COPY_BYTES_PER_SECOND
    return HostWork(between_s=last_copy_s + elements * HOST_LOSS_SECONDS_PER_ELEMENT)
