"""Does a run fit at all? The least-memory plans checked against the GPUs and the host's usable RAM.

The host's usable RAM is its RAM less a headroom for what is not the training state: the OS and
its page cache, the CUDA driver's and torch's libraries in the process, the Python heap, the data
loader's worker processes and their shared-memory batches, a checkpoint being written. The default
headroom, ``max(10% of RAM, 8 GiB)``, is argued in ``host_headroom_bytes``.

``fit_problems`` names every reason a run does not fit, host and GPU, and its figures are lower
bounds on what any plan needs: the GPU figure is the finest plan's (one layer per stage, the least
a worker can hold), the host figure the coarsest backward cut's (one stage input saved per
microbatch, the least the host can keep).
"""

from __future__ import annotations

from ..cost.activations import DEFAULT_LOSS_CHUNK_TOKENS
from ..cost.device_overheads import extra_attention_backward_bytes_per_token, two_pool_budget_bytes, usable_gpu_bytes
from ..cost.hardware import HardwareProfile
from ..cost.memory import HostMemory, host_bytes, roundpipe_gpu_bytes
from ..cost.profile import CostProfile
from ..cost.quantization import packed_costs
from ..cost.transformer import ModelShape, preset_costs
from ..cost.view import CostView
from ..schedule.plan import Plan, PlanFacts

GiB = 2**30
# Headroom: 10% scales with the machine (page tables, the page cache a data set and checkpoints
# stream through, allocator fragmentation of a heap this size), and mirrors the GPUs' 10% margin;
# 8 GiB is the floor a small machine still needs (the OS ~1-2 GiB, the process's CUDA and torch
# libraries ~2-3 GiB, the Python heap and tokenizer ~1 GiB, a few data loader workers ~0.5-1 GiB each).
DEFAULT_HOST_HEADROOM_FRACTION = 0.10
MIN_HOST_HEADROOM_BYTES = 8 * GiB


def host_headroom_bytes(host_memory_bytes: int, headroom_bytes: int | None = None) -> int:
    """RAM kept free of training state: ``headroom_bytes`` when given, else ``max(10% of RAM, 8 GiB)``
    (module doc), never more than the RAM itself."""
    if headroom_bytes is None:
        headroom_bytes = max(int(DEFAULT_HOST_HEADROOM_FRACTION * host_memory_bytes), MIN_HOST_HEADROOM_BYTES)
    if headroom_bytes < 0:
        raise ValueError(f"host headroom must not be negative, got {headroom_bytes} bytes")
    return min(int(headroom_bytes), int(host_memory_bytes))


def finest_plan(num_layers: int, fused_last: bool) -> Plan:
    """One layer per stage in both directions: the least memory a plan can need."""
    ranges = tuple((i, i + 1) for i in range(num_layers))
    return Plan(num_layers, ranges, ranges, fused_last=fused_last, facts=PlanFacts(policy="finest")).validate()


def least_memory_plans(num_layers: int, fused_last: bool) -> list[Plan]:
    """One layer per forward stage; backward stages of 1, 2, 4, ... layers (the finest plan first).

    The finest plan needs the least worker memory; a coarser backward cut saves fewer stage
    inputs on the host (one per backward stage and microbatch), for more worker memory (little
    more with layer-grain recompute)."""
    plans = [finest_plan(num_layers, fused_last)]
    forward = plans[0].forward
    cut = num_layers - 1 if fused_last else num_layers  # a fused last stage is one layer both ways
    k = 2
    while k < 2 * cut:
        backward = tuple((a, min(a + k, cut)) for a in range(0, cut, k)) + (((cut, num_layers),) if fused_last else ())
        plans.append(Plan(num_layers, forward, backward, fused_last=fused_last,
                          facts=PlanFacts(policy=f"finest forward, {k}-layer backward")).validate())
        k *= 2
    return plans


def model_costs(shape: ModelShape, hardware: HardwareProfile, seq_len: int, microbatch_size: int,
                lora_rank: int | None, loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
                quantize: str | None = None) -> CostProfile:
    """The cost profile the planner prices: the preset's, with the flash-attention backward workspace
    where it outgrows the MLP's gradients, and packed base weights with ``quantize`` ("nf4")."""
    if quantize and not lora_rank:
        raise ValueError(f"a {quantize} base is frozen: quantization needs LoRA (give a LoRA rank)")
    costs = preset_costs(shape, hardware, seq_len, microbatch_size, lora_rank=lora_rank,
                         loss_chunk_tokens=loss_chunk_tokens)
    # On a GPU the attention backward's flash-attention workspace may outgrow the MLP's gradients
    # (cost/device_overheads.py); the backward peak is the larger of the two.
    start, end = costs.decoder_layers
    for layer in costs.layers[start:end]:
        layer.backward_transient_bytes_per_token += extra_attention_backward_bytes_per_token(
            shape, layer.backward_transient_bytes_per_token, costs.dtype_bytes)
    return packed_costs(costs, shape, hardware, quantize) if quantize else costs


def fit_problems(costs: CostProfile, hardware: HardwareProfile, memory_fraction: float, microbatches: int,
                 fused_last: bool, recompute: str = "stage", *, host_budget_bytes: float | None = None,
                 optimizer_undo: bool = True) -> tuple[list[str], HostMemory, int]:
    """Every reason the run cannot fit with any of the least-memory plans (none when one fits), the
    host memory and the GPU need: of the first plan that fits, else the least any plan needs (module
    doc). ``host_budget_bytes``: the host's usable RAM (default: all of it)."""
    budget = two_pool_budget_bytes(usable_gpu_bytes(hardware, memory_fraction))  # the runtime's budget (two pools)
    host_budget = hardware.host_memory_bytes if host_budget_bytes is None else host_budget_bytes
    plans = least_memory_plans(len(costs.layers), fused_last)
    for plan in plans:
        host = host_bytes(costs, plan, microbatches, optimizer_undo)
        gpu = max(roundpipe_gpu_bytes(plan, costs, hardware.num_gpus, recompute=recompute))
        if host.total <= host_budget and gpu <= budget:
            return [], host, gpu
    finest_host = host_bytes(costs, plans[0], microbatches, optimizer_undo)
    least_host = host_bytes(costs, plans[-1], microbatches, optimizer_undo)
    gpu = max(roundpipe_gpu_bytes(plans[0], costs, hardware.num_gpus, recompute=recompute))
    problems = []
    if least_host.total > host_budget:
        problems.append(f"host memory: needs at least {least_host.total / GiB:.1f} GiB (with one backward stage, "
                        f"the fewest saved stage inputs) but {host_budget / GiB:.1f} GiB is usable")
    if gpu > budget:
        view = CostView(costs)
        heaviest = max(range(len(view)), key=lambda i: view.graph_per_token[i])
        problems.append(f"GPU memory: even with one layer per stage a worker needs {gpu / GiB:.1f} GiB of "
                        f"{budget / GiB:.1f} GiB budget (layer {heaviest} keeps {view.graph(heaviest, heaviest + 1) / GiB:.1f} "
                        f"GiB of activations per microbatch)")
        if least_host.total <= host_budget < finest_host.total:
            problems.append(f"host memory: one layer per stage, the least GPU memory, saves "
                            f"{finest_host.saved_inputs_per_microbatch} stage inputs x {microbatches} microbatches "
                            f"({finest_host.saved_activations / GiB:.1f} GiB) and needs {finest_host.total / GiB:.1f} GiB "
                            f"of {host_budget / GiB:.1f} GiB usable; coarser backward stages save fewer but need "
                            f"more GPU memory")
    if not problems:
        problems.append(f"no plan fits both memories: one layer per stage keeps {finest_host.total / GiB:.1f} GiB on the "
                        f"host (saved stage inputs {finest_host.saved_activations / GiB:.1f} GiB) of "
                        f"{host_budget / GiB:.1f} GiB usable, and coarser backward stages need more worker memory "
                        f"than the {budget / GiB:.1f} GiB budget")
    return problems, least_host, gpu


SEQ_QUANTUM = 256  # the longest-sequence search moves in steps of this many tokens
MAX_SEQ_LEN = 1 << 20


def longest_multiple(fits, quantum: int, max_seq_len: int) -> int | None:
    """The longest multiple of ``quantum`` up to ``max_seq_len`` that ``fits`` (which must be
    monotone: a length fits only if every shorter one does), found by doubling then bisection;
    None when not even ``quantum`` fits."""
    top = max_seq_len // quantum
    lo, hi = 0, 1  # in quanta: lo fits (0 = nothing), hi is the first candidate to test
    while hi <= top and fits(hi * quantum):
        lo, hi = hi, hi * 2
    hi = min(hi, top + 1)
    while hi - lo > 1:  # invariant: lo fits (or is 0), hi does not (or is past the cap)
        mid = (lo + hi) // 2
        if fits(mid * quantum):
            lo = mid
        else:
            hi = mid
    return lo * quantum if lo else None


def longest_fitting_seq(shape: ModelShape, hardware: HardwareProfile, *, microbatch_size: int, lora_rank: int | None,
                        microbatches: int, loss_chunk_tokens: int | None, memory_fraction: float, fused_last: bool,
                        recompute: str, host_budget_bytes: float, optimizer_undo: bool = True,
                        quantize: str | None = None) -> int | None:
    """Longest sequence (a multiple of ``SEQ_QUANTUM``, at most ``MAX_SEQ_LEN``) for which one of the
    least-memory plans fits both the GPUs and ``host_budget_bytes`` of host RAM."""
    def fits(seq: int) -> bool:
        costs = model_costs(shape, hardware, seq, microbatch_size, lora_rank, loss_chunk_tokens, quantize)
        return not fit_problems(costs, hardware, memory_fraction, microbatches, fused_last, recompute,
                                host_budget_bytes=host_budget_bytes, optimizer_undo=optimizer_undo)[0]

    return longest_multiple(fits, SEQ_QUANTUM, MAX_SEQ_LEN)
