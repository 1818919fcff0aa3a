"""The planner: will this training run fit, and how should it be cut and fed?

``plan_training`` takes a model (a preset name or a ``ModelShape``), a hardware
profile and a sequence length, and answers:

- whether the host can hold the training state (fp32 masters, gradients and Adam moments, or
  LoRA adapters' state plus the frozen compute-dtype base) and the saved activations;
- whether a worker can hold two stages' weights (and a stage's gradients) plus one microbatch's
  activations, under ``memory_fraction`` of what its memory leaves after the CUDA context,
  cuBLAS workspaces and allocator pages (``cost/device_overheads.py``);
- which plan and microbatch count give the most tokens/s (candidates: the project's
  ``partition("auto")`` when present and balanced plans with 2-6 stages per worker, each timed by
  ``simulate_roundpipe``); the smallest microbatch count
  within 5% of the best throughput is recommended, as it keeps the global batch small;
- the longest sequence length that fits at all (one layer per forward stage, backward stages of
  1, 2, 4, ... layers: fewer backward stages keep fewer stage inputs on the host), with its
  throughput; ``longest_fitting_seq_len`` answers the same for any cost profile, plan and
  per-worker cap;
- the recompute grain: stage grain (a backward stage's whole graph) where it fits, else layer
  grain (``recompute="layer"``: one layer's graph plus the stage's layer inputs), which lets
  larger backward stages (and so fewer saved stage inputs) fit at long sequences. Layer grain
  runs each backward stage's layers but its last once more without grad; the simulations time
  and hold what the lowered layer-grain computes do (``SimConfig.layer_recompute``).

The loss is the engine's chunked cross-entropy (``DEFAULT_LOSS_CHUNK_TOKENS`` rows of logits at
a time, what a Hugging Face model's fused last stage uses) unless ``loss_chunk_tokens`` says
otherwise (None: the full logits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..cost.profile import CostProfile
from ..schedule.plan import Plan, PlanFacts
from ..cost.view import CostView
from ..cost.hardware import HardwareProfile, load_hardware
from ..cost.memory import HostMemory, host_bytes, roundpipe_gpu_bytes
from ..cost.transformer import ModelShape, get_model_shape, preset_costs
from .balanced import balanced_plan, make_plan
from ..cost.activations import DEFAULT_LOSS_CHUNK_TOKENS
from ..cost.device_overheads import extra_attention_backward_bytes_per_token, usable_gpu_bytes
from ..sim.simulate import SimConfig, SimResult, simulate_roundpipe

DEFAULT_MEMORY_FRACTION = 0.9  # of what a GPU leaves after its context and workspaces (cost/device_overheads.py)
STAGES_PER_WORKER = (2, 3, 4, 6)
NEAR_BEST = 0.95  # recommend the smallest microbatch count within this share of the best tokens/s
SEQ_QUANTUM = 256  # the longest-sequence search moves in steps of this many tokens
MAX_SEQ_LEN = 1 << 20
GiB = 2**30
RECOMPUTE_CHOICES = ("auto", "stage", "layer")  # auto: stage grain where it fits, else layer grain


@dataclass
class PlanChoice:
    """A plan, a microbatch count, and what the simulator predicts for them."""

    plan: Plan
    microbatches: int
    result: SimResult
    gpu_bytes: int  # memory bound of the busiest worker (see memory.py)


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


def candidate_plans(costs: CostProfile, num_workers: int, microbatches: int, budget: float,
                    link_bytes_per_s: float, fused_last: bool) -> list[Plan]:
    """Plans worth timing: the partitioner's choice and balanced plans of several sizes."""
    plans = [make_plan(costs, num_workers, microbatches, memory_budget_bytes=int(budget),
                       link_bytes_per_second=link_bytes_per_s, fused_last=fused_last)]
    plans += [balanced_plan(costs, k * num_workers, fused_last=fused_last) for k in STAGES_PER_WORKER]
    plans.append(finest_plan(len(costs.layers), fused_last))
    unique: dict[str, Plan] = {}
    for plan in plans:
        unique.setdefault(plan.to_text(), plan)
    return list(unique.values())


def best_plan(
    costs: CostProfile,
    hardware: HardwareProfile,
    microbatch_options: list[int],
    *,
    num_workers: int | None = None,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
    fused_last: bool = True,
    config: SimConfig | None = None,
    host_budget_bytes: float | None = None,
    recompute: str = "stage",
) -> PlanChoice | None:
    """Fastest fitting (plan, microbatch count), preferring fewer microbatches when nearly as fast.

    Returns ``None`` when no candidate plan fits the worker memory (or, with
    ``host_budget_bytes``, the host memory). ``recompute``: the grain of backward stages,
    "stage" or "layer" (memory per ``roundpipe_gpu_bytes``;
    the simulations lower the plan with layer-grain computes, ``SimConfig.layer_recompute``).
    """
    nw = num_workers or hardware.num_gpus
    config = dataclasses.replace(config or SimConfig(), layer_recompute=recompute == "layer")
    budget = usable_gpu_bytes(hardware, memory_fraction)
    best_per_m: dict[int, PlanChoice] = {}

    def time_fitting(plans_of) -> None:
        for m in microbatch_options:
            for plan in plans_of(m):
                need = max(roundpipe_gpu_bytes(plan, costs, nw, recompute=recompute))
                if need > budget:
                    continue
                if host_budget_bytes is not None and host_bytes(costs, plan, m).total > host_budget_bytes:
                    continue
                result = simulate_roundpipe(plan, costs, hardware, m, num_workers=nw, config=config)
                if m not in best_per_m or result.tokens_per_s > best_per_m[m].result.tokens_per_s:
                    best_per_m[m] = PlanChoice(plan, m, result, need)

    time_fitting(lambda m: candidate_plans(costs, nw, m, budget, hardware.host_device_bytes_per_s, fused_last))
    if not best_per_m:
        # Long sequences: the host may not keep one input per layer and microbatch, so the
        # least-memory plans with coarser backward cuts are tried too.
        time_fitting(lambda m: least_memory_plans(len(costs.layers), fused_last)[1:])
    if not best_per_m:
        return None
    top = max(c.result.tokens_per_s for c in best_per_m.values())
    return min((c for c in best_per_m.values() if c.result.tokens_per_s >= NEAR_BEST * top),
               key=lambda c: c.microbatches)


@dataclass
class TrainingPlan:
    """The planner's answer; ``to_text`` renders it for people."""

    model: ModelShape
    hardware: HardwareProfile
    seq_len: int
    microbatch_size: int
    lora_rank: int | None
    memory_fraction: float
    fits: bool
    reasons: list[str]  # why it does not fit (empty when it fits)
    host: HostMemory
    min_gpu_bytes: int  # least a worker needs at this sequence length (one layer per stage)
    choice: PlanChoice | None
    max_seq_len: int | None = None
    max_seq_choice: PlanChoice | None = None
    searched_max_seq: bool = False  # True once the longest fitting sequence was looked for
    recompute: str = "stage"  # the recompute grain the verdict and the recommendation assume
    loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS  # rows of logits at a time (None: all)
    max_seq_recompute: str = "stage"  # the grain the longest sequence needs
    max_seq_len_stage_grain: int | None = None  # the longest with stage grain (searched with auto)

    @property
    def gpu_budget_bytes(self) -> float:
        """The share of each GPU's memory the plan may use."""
        return usable_gpu_bytes(self.hardware, self.memory_fraction)

    def to_text(self) -> str:
        """The plan as the ``sim plan`` command prints it."""
        hw, shape = self.hardware, self.model
        mode = f"LoRA rank {self.lora_rank}" if self.lora_rank else "full fine-tuning"
        lines = [
            f"{shape.name} ({shape.num_params() / 1e9:.2f}B parameters), {mode}, on {hw.name} "
            f"({hw.num_gpus} x {hw.gpu_memory_bytes / GiB:.1f} GiB GPUs, {hw.host_memory_bytes / GiB:.0f} GiB host), "
            f"sequences of {self.seq_len} tokens, microbatch size {self.microbatch_size}",
            f"Verdict: {'fits' if self.fits else 'does not fit'}",
            f"Recompute: {self.recompute} grain"
            + (" (stage grain does not fit: one layer's graph at a time, one more forward per backward stage)"
               if self.recompute == "layer" else ""),
            "Loss: " + (f"chunked cross-entropy, {self.loss_chunk_tokens} rows of logits at a time"
                        if self.loss_chunk_tokens else "full logits"),
        ]
        h = self.host
        lines.append(
            f"Host memory: {h.total / GiB:.1f} GiB needed of {hw.host_memory_bytes / GiB:.1f} GiB "
            f"(fp32 optimizer state {h.optimizer_state / GiB:.1f}, compute-dtype copy {h.compute_copy / GiB:.1f}, "
            f"gradient download buffers {h.gradient_downloads / GiB:.1f}, saved activations {h.saved_activations / GiB:.1f}, "
            f"failed-step undo copy {h.undo_images / GiB:.1f})"
        )
        lines.append(
            f"Pinned host memory: {h.pinned / GiB:.1f} GiB of that is page-locked under a pinned policy and cannot be "
            f"swapped (upload copy {h.pinned_upload_bytes_per_param:.1f} B/param, gradient download buffers, "
            f"saved activations)"
        )
        need = self.choice.gpu_bytes if self.choice else self.min_gpu_bytes
        lines.append(
            f"GPU memory per worker: {need / GiB:.1f} GiB needed of {self.gpu_budget_bytes / GiB:.1f} GiB usable "
            f"({self.memory_fraction:.0%} of {hw.gpu_memory_bytes / GiB:.1f} GiB"
            + (f" less {hw.reserved_gpu_bytes / GiB:.2f} GiB of CUDA context and workspaces" if hw.reserved_gpu_bytes else "")
            + "; two stages' weights and gradients "
            f"+ one microbatch's activations)"
        )
        for reason in self.reasons:
            lines.append(f"  - {reason}")
        if self.choice:
            c, r = self.choice, self.choice.result
            lines += [
                f"Recommended: {c.microbatches} microbatches per step ({r.tokens_per_step} tokens per step)",
                f"Plan ({len(c.plan.forward)} forward + {len(c.plan.dispatched_backward_stages())} backward stages, "
                f"policy {c.plan.facts.policy or '?'}): {c.plan.to_text()}",
                f"Predicted: {r.step_s:.3f} s per step, {r.tokens_per_s:,.0f} tokens/s, bubble {r.bubble_fraction:.1%}, "
                f"simulated peak GPU memory {r.max_peak_gpu_bytes / GiB:.1f} GiB",
            ]
        if self.max_seq_len is not None:
            extra = ""
            if self.max_seq_choice is not None:
                mc = self.max_seq_choice
                extra = (f": {mc.microbatches} microbatches, {mc.result.tokens_per_s:,.0f} tokens/s "
                         f"with plan {mc.plan.to_text()}")
            grain = f" ({self.max_seq_recompute}-grain recompute"
            if self.max_seq_recompute == "layer":
                stage = self.max_seq_len_stage_grain
                grain += f"; stage grain: {stage} tokens" if stage else "; stage grain: none"
            lines.append(f"Longest sequence that fits: {self.max_seq_len} tokens{grain}){extra}")
        elif self.searched_max_seq:
            lines.append(f"Longest sequence that fits: none (not even {SEQ_QUANTUM} tokens)")
        return "\n".join(lines)


def _costs(shape: ModelShape, hardware: HardwareProfile, seq_len: int, microbatch_size: int,
           lora_rank: int | None, loss_chunk_tokens: int | None) -> CostProfile:
    costs = preset_costs(shape, hardware, seq_len, microbatch_size, lora_rank=lora_rank,
                         loss_chunk_tokens=loss_chunk_tokens)
    # On a GPU the attention backward's flash-attention workspace may outgrow the MLP's gradients
    # (cost/device_overheads.py); the backward peak is the larger of the two.
    start, end = costs.decoder_layers
    for layer in costs.layers[start:end]:
        layer.backward_transient_bytes_per_token += extra_attention_backward_bytes_per_token(
            shape, layer.backward_transient_bytes_per_token, costs.dtype_bytes)
    return costs


def _fit_problems(costs: CostProfile, hardware: HardwareProfile, memory_fraction: float, microbatches: int,
                  fused_last: bool, recompute: str = "stage") -> tuple[list[str], HostMemory, int]:
    """Reasons the run cannot fit with any of the least-memory plans (none when one fits), host
    memory and GPU need (of the first plan that fits, else of the finest plan)."""
    budget = usable_gpu_bytes(hardware, memory_fraction)
    for plan in least_memory_plans(len(costs.layers), fused_last):
        host = host_bytes(costs, plan, microbatches)
        gpu = max(roundpipe_gpu_bytes(plan, costs, hardware.num_gpus, recompute=recompute))
        if host.total <= hardware.host_memory_bytes and gpu <= budget:
            return [], host, gpu
    finest = finest_plan(len(costs.layers), fused_last)
    host = host_bytes(costs, finest, microbatches)
    gpu = max(roundpipe_gpu_bytes(finest, costs, hardware.num_gpus, recompute=recompute))
    problems = []
    coarsest_host = host_bytes(costs, least_memory_plans(len(costs.layers), fused_last)[-1], microbatches)
    if coarsest_host.total > hardware.host_memory_bytes:
        problems.append(f"host memory: needs {coarsest_host.total / GiB:.1f} GiB but the host has "
                        f"{hardware.host_memory_bytes / GiB:.1f} GiB (try LoRA, or a machine with more RAM)")
    if gpu > budget:
        view = CostView(costs)
        heaviest = max(range(len(view)), key=lambda i: view.graph_per_token[i])
        problems.append(f"GPU memory: even with one layer per stage a worker needs {gpu / GiB:.1f} GiB of "
                        f"{budget / GiB:.1f} GiB usable (layer {heaviest} keeps {view.graph(heaviest, heaviest + 1) / GiB:.1f} "
                        f"GiB of activations per microbatch); use shorter sequences or a smaller microbatch")
    if not problems:
        problems.append(f"no plan fits both memories: one layer per stage keeps {host.total / GiB:.1f} GiB on the host "
                        f"(saved stage inputs {host.saved_activations / GiB:.1f} GiB), and coarser backward stages need "
                        f"more worker memory than the {budget / GiB:.1f} GiB usable; use fewer microbatches"
                        + (" or recompute='layer'" if recompute == "stage" else ""))
    return problems, host, gpu


def fitting_recompute(costs: CostProfile, hardware: HardwareProfile, microbatches: int, *,
                      memory_fraction: float = DEFAULT_MEMORY_FRACTION, fused_last: bool = True) -> str | None:
    """The recompute grain a run with ``costs`` fits with: "stage" when one of the least-memory
    plans fits at stage grain (it costs no extra forward), else "layer" when one fits at layer
    grain, else None."""
    for grain in ("stage", "layer"):
        if not _fit_problems(costs, hardware, memory_fraction, microbatches, fused_last, grain)[0]:
            return grain
    return None


def plan_training(
    model: str | ModelShape,
    hardware: str | HardwareProfile,
    seq_len: int = 4096,
    *,
    microbatch_size: int = 1,
    lora_rank: int | None = None,
    microbatches: int | None = None,
    loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
    find_max_seq_len: bool = True,
    fused_last: bool = True,
    config: SimConfig | None = None,
    recompute: str = "auto",
) -> TrainingPlan:
    """Decide whether training fits and recommend microbatches, a plan, the recompute grain and the longest sequence.

    ``microbatches`` fixes the count; by default 1, 2 and 4 per worker are tried. ``fused_last``
    (default on) assumes the model computes its own loss, as a Hugging Face causal LM given
    labels does, with the engine's chunked loss of ``loss_chunk_tokens`` rows (None: full
    logits). ``recompute``: "auto" (stage grain where it fits, else layer grain), "stage" or
    "layer". ``config`` tunes the simulations (default: 2 simulated steps, enough for the
    planner's comparisons, with the overlapped optimizer's failed-step undo copy priced, as a
    GPU server runs it by default; its bytes are in the host figure too).
    """
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, got {recompute!r}")
    shape = get_model_shape(model)
    hw = load_hardware(hardware)
    cfg = config or SimConfig(steps=2, optimizer_undo=True)
    nw = hw.num_gpus
    options = [microbatches] if microbatches else [nw, 2 * nw, 4 * nw]
    costs = _costs(shape, hw, seq_len, microbatch_size, lora_rank, loss_chunk_tokens)
    grains = ("stage", "layer") if recompute == "auto" else (recompute,)
    for grain in grains:
        problems, host, min_gpu = _fit_problems(costs, hw, memory_fraction, min(options), fused_last, grain)
        choice = None
        if not problems:
            choice = best_plan(costs, hw, options, memory_fraction=memory_fraction, fused_last=fused_last,
                               config=cfg, host_budget_bytes=hw.host_memory_bytes, recompute=grain)
            if choice is None:
                problems.append("no candidate plan fits both the worker and the host memory")
            else:
                host = host_bytes(costs, choice.plan, choice.microbatches)
        if not problems:
            break
    if problems and len(grains) > 1:  # neither fits: report stage grain's reasons, the default's
        grain = "stage"
        problems, host, min_gpu = _fit_problems(costs, hw, memory_fraction, min(options), fused_last, grain)
    report = TrainingPlan(shape, hw, seq_len, microbatch_size, lora_rank, memory_fraction, not problems, problems,
                          host, min_gpu, choice if not problems else None, recompute=grain,
                          loss_chunk_tokens=loss_chunk_tokens)
    if find_max_seq_len:
        report.searched_max_seq = True
        kwargs = dict(microbatch_size=microbatch_size, lora_rank=lora_rank, microbatches=min(options),
                      loss_chunk_tokens=loss_chunk_tokens, memory_fraction=memory_fraction, fused_last=fused_last)
        longest = longest_seq_len(shape, hw, recompute=grains[0], **kwargs)
        report.max_seq_len_stage_grain = longest if grains[0] == "stage" else None
        report.max_seq_recompute = grains[0]
        if len(grains) > 1:
            layer = longest_seq_len(shape, hw, recompute="layer", **kwargs)
            if layer is not None and (longest is None or layer > longest):
                longest, report.max_seq_recompute = layer, "layer"
        report.max_seq_len = longest
        if longest is not None:
            long_costs = _costs(shape, hw, longest, microbatch_size, lora_rank, loss_chunk_tokens)
            report.max_seq_choice = best_plan(long_costs, hw, [min(options)], memory_fraction=memory_fraction,
                                              fused_last=fused_last, config=cfg, host_budget_bytes=hw.host_memory_bytes,
                                              recompute=report.max_seq_recompute)
    return report


def longest_seq_len(
    model: str | ModelShape,
    hardware: str | HardwareProfile,
    *,
    microbatch_size: int = 1,
    lora_rank: int | None = None,
    microbatches: int | None = None,
    loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
    fused_last: bool = True,
    recompute: str = "stage",
) -> int | None:
    """Longest sequence (a multiple of 256 tokens, at most 1M) for which one of the least-memory plans
    (``least_memory_plans``) fits, with backward stages recomputed at ``recompute`` grain
    ("stage" or "layer")."""
    if recompute not in ("stage", "layer"):
        raise ValueError(f"recompute must be 'stage' or 'layer', got {recompute!r}")
    shape, hw = get_model_shape(model), load_hardware(hardware)
    m = microbatches or hw.num_gpus

    def fits(seq: int) -> bool:
        costs = _costs(shape, hw, seq, microbatch_size, lora_rank, loss_chunk_tokens)
        return not _fit_problems(costs, hw, memory_fraction, m, fused_last, recompute)[0]

    return _longest(fits, SEQ_QUANTUM, MAX_SEQ_LEN)


def _longest(fits: Callable[[int], bool], quantum: int, max_seq_len: int) -> int | None:
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


def longest_fitting_seq_len(
    costs_for: Callable[[int], CostProfile],
    plan: Plan,
    num_workers: int,
    cap_bytes: float,
    *,
    link_bytes_per_second: float | None = None,
    quantum: int = SEQ_QUANTUM,
    max_seq_len: int = MAX_SEQ_LEN,
    continue_round_robin: bool = True,
    microbatches: int | None = None,
) -> int | None:
    """Longest sequence (a multiple of ``quantum``, at most ``max_seq_len``) at which every worker's
    predicted peak (``roundpipe_gpu_bytes`` of ``plan`` over
    ``costs_for(seq_len)``) stays within ``cap_bytes``; None when not even ``quantum`` tokens fit.

    For any model and cost profile: ``costs_for`` builds the profile of one sequence length (for a
    preset, ``lambda s: preset_costs(name, hardware, s)``), so the same question can be put to the CPU
    backend with a per-worker cap (``cpu_memory_cap_bytes``, with ``link_bytes_per_second=math.inf``:
    its transfers are memory copies) and checked end to end.
    """
    if quantum < 1 or max_seq_len < quantum:
        raise ValueError(f"need 1 <= quantum <= max_seq_len, got quantum={quantum}, max_seq_len={max_seq_len}")

    def fits(seq: int) -> bool:
        peaks = roundpipe_gpu_bytes(plan, costs_for(seq), num_workers, continue_round_robin=continue_round_robin,
                                    link_bytes_per_second=link_bytes_per_second, microbatches=microbatches)
        return max(peaks) <= cap_bytes

    return _longest(fits, quantum, max_seq_len)
