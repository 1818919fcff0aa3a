"""The planner: will this training run fit, and how should it be cut and fed?

``plan_training`` takes a model (a preset name or a ``ModelShape``), a hardware profile and a
sequence length, and answers whether host RAM and each worker's memory hold the run, which plan
and microbatch count give the most tokens/s (timed by ``simulate_roundpipe``), the longest
sequence that fits, the recompute grain, and what would make a run that does not fit fit
(``advice.py``), with the pinned bytes and the ``memlock`` limit they need. It states the host RAM
it assumed rather than assuming silently. What each answer counts: docs/design.md, design notes,
``planning/capacity.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

from ..cost.profile import CostProfile
from ..schedule.plan import Plan
from ..cost.hardware import HardwareProfile, load_hardware
from ..cost.memory import DEFAULT_UNDO_JOURNAL_BYTES, HostMemory, host_bytes, memlock_kib, roundpipe_gpu_bytes
from ..cost.transformer import ModelShape, get_model_shape
from .advice import Alternative, RunSettings, alternatives
from .balanced import balanced_plan, make_plan
from .fit import host_headroom_bytes as host_headroom_bytes_of
from .fit import (MAX_SEQ_LEN, SEQ_QUANTUM, DEFAULT_HOST_HEADROOM_FRACTION, MIN_HOST_HEADROOM_BYTES, finest_plan,
                  fit_problems, least_memory_plans, longest_fitting_seq, longest_multiple,
                  model_costs)
from ..cost.activations import DEFAULT_LOSS_CHUNK_TOKENS
from ..cost.device_overheads import TWO_POOL_SHARE, two_pool_budget_bytes, usable_gpu_bytes
from ..sim.simulate import SimConfig, SimResult, simulate_roundpipe

DEFAULT_MEMORY_FRACTION = 0.9  # of what a GPU leaves after its context and workspaces (cost/device_overheads.py)
STAGES_PER_WORKER = (2, 3, 4, 6)
NEAR_BEST = 0.95  # recommend the smallest microbatch count within this share of the best tokens/s
GiB = 2**30
RECOMPUTE_CHOICES = ("auto", "stage", "layer")  # auto: stage grain where it fits, else layer grain


@dataclass
class PlanChoice:
    """A plan, a microbatch count, and what the simulator predicts for them."""

    plan: Plan
    microbatches: int
    result: SimResult
    gpu_bytes: int  # memory bound of the busiest worker (see memory.py)


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
    optimizer_undo: bool = True,
) -> PlanChoice | None:
    """Fastest fitting (plan, microbatch count), preferring fewer microbatches when nearly as fast.

    Returns ``None`` when no candidate plan fits the worker memory (or, with
    ``host_budget_bytes``, the host memory). ``recompute``: the grain of backward stages,
    "stage" or "layer" (memory per ``roundpipe_gpu_bytes``;
    the simulations lower the plan with layer-grain computes, ``SimConfig.layer_recompute``).
    ``optimizer_undo``: the host keeps the failed-step undo copy (``host_bytes``).
    """
    nw = num_workers or hardware.num_gpus
    config = dataclasses.replace(config or SimConfig(), layer_recompute=recompute == "layer")
    budget = two_pool_budget_bytes(usable_gpu_bytes(hardware, memory_fraction))  # what the runtime's keeper gets
    best_per_m: dict[int, PlanChoice] = {}

    def time_fitting(plans_of) -> None:
        for m in microbatch_options:
            for plan in plans_of(m):
                need = max(roundpipe_gpu_bytes(plan, costs, nw, recompute=recompute))
                if need > budget:
                    continue
                if host_budget_bytes is not None and host_bytes(costs, plan, m, optimizer_undo).total > host_budget_bytes:
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


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one ("1 stage input", "8 microbatches")."""
    return f"{n} {noun}" + ("" if n == 1 else "es" if noun.endswith("h") else "s")


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
    host_memory_source: str = ""  # where the host RAM figure came from ("--host-memory 192GB", a profile)
    host_headroom_bytes: int = 0  # RAM kept free for the OS and the data pipeline
    host_headroom_given: bool = False  # False: the default rule (fit.host_headroom_bytes)
    optimizer_undo: bool = True  # the host keeps the failed-step undo copy
    quantize: str | None = None  # packed base weights ("nf4")
    advice: list[Alternative] = field(default_factory=list)  # options that would make it fit (when it does not)

    @property
    def host_budget_bytes(self) -> int:
        """Host RAM the training state may use: the RAM less the headroom."""
        return self.hardware.host_memory_bytes - self.host_headroom_bytes

    @property
    def gpu_usable_bytes(self) -> float:
        """What the memory model lets a worker's tensors fill (``usable_gpu_bytes``)."""
        return usable_gpu_bytes(self.hardware, self.memory_fraction)

    @property
    def gpu_budget_bytes(self) -> int:
        """The share of each GPU's memory the plan may use: the runtime's budget, ``two_pool_budget_bytes``."""
        return two_pool_budget_bytes(self.gpu_usable_bytes)

    def host_ram_line(self) -> str:
        """The host RAM assumed, where the figure came from, and the headroom kept free of it."""
        hw = self.hardware
        source = self.host_memory_source or f"the {hw.name} profile"
        rule = ("--host-headroom" if self.host_headroom_given else
                f"default: {DEFAULT_HOST_HEADROOM_FRACTION:.0%} of RAM, at least {MIN_HOST_HEADROOM_BYTES / GiB:.0f} GiB; "
                f"--host-headroom sets it")
        return (f"Host RAM assumed: {hw.host_memory_bytes / GiB:.1f} GiB, from {source}; "
                f"{self.host_headroom_bytes / GiB:.1f} GiB kept free for the OS and the data pipeline ({rule}): "
                f"{self.host_budget_bytes / GiB:.1f} GiB usable for training")

    def to_text(self) -> str:
        """The plan as the ``sim plan`` command prints it."""
        hw, shape = self.hardware, self.model
        mode = f"LoRA rank {self.lora_rank}" if self.lora_rank else "full fine-tuning"
        if self.lora_rank and shape.lora_targets == "attention":
            mode += " (q, k, v, o)"
        if self.quantize:
            mode += f" on a 4-bit {self.quantize.upper()} base"
        # each reason by the memory it names; "no (candidate) plan fits both ..." names the two together
        short = sorted({r.split(":")[0] if r.split(":")[0] in ("host memory", "GPU memory")
                        else "host and GPU memory together" for r in self.reasons}, key=lambda r: r != "host memory")
        lines = [
            f"{shape.name} ({shape.num_params() / 1e9:.2f}B parameters), {mode}, on {hw.name} "
            f"({hw.num_gpus} x {hw.gpu_memory_bytes / GiB:.1f} GiB GPUs), "
            f"sequences of {self.seq_len} tokens, microbatch size {self.microbatch_size}",
            self.host_ram_line(),
            "Verdict: " + ("fits" if self.fits else f"does not fit ({', '.join(short)})"),
            f"Recompute: {self.recompute} grain"
            + (" (stage grain does not fit: one layer's graph at a time, one more forward per backward stage)"
               if self.recompute == "layer" else ""),
            "Loss: " + (f"chunked cross-entropy, {self.loss_chunk_tokens} rows of logits at a time"
                        if self.loss_chunk_tokens else "full logits"),
        ]
        h = self.host
        saved = (f" ({_count(h.saved_inputs_per_microbatch, 'stage input')} x {_count(h.microbatches, 'microbatch')})"
                 if h.microbatches else "")
        lines.append(
            f"Host memory: {'' if self.fits else 'at least '}{h.total / GiB:.1f} GiB needed of "
            f"{self.host_budget_bytes / GiB:.1f} GiB usable "
            f"(fp32 optimizer state {h.optimizer_state / GiB:.1f}, "
            f"{'packed ' + self.quantize + ' base and ' if self.quantize else ''}compute-dtype copy "
            f"{h.compute_copy / GiB:.1f}, gradient download buffers {h.gradient_downloads / GiB:.1f}, "
            f"saved activations {h.saved_activations / GiB:.1f}{saved}, failed-step undo journal "
            + (f"{h.undo_images / GiB:.1f}, at most optimizer_undo_journal_bytes)" if self.optimizer_undo
               else "off: optimizer_undo=False)")
        )
        lines.append(
            f"Pinned host memory: {h.pinned / GiB:.1f} GiB of that is page-locked under a pinned policy and cannot be "
            f"swapped (upload copy {h.pinned_upload_bytes_per_param:.{1 if h.pinned_upload_bytes_per_param >= 1 else 2}f} B/param, gradient download buffers, "
            f"saved activations); locked-memory limit needed: ulimit -l {memlock_kib(h.pinned)} (KiB) or unlimited "
            f"(containers: --ulimit memlock=-1)"
        )
        need = self.choice.gpu_bytes if self.choice else self.min_gpu_bytes
        lines.append(
            f"GPU memory per worker: {'' if self.fits else 'at least '}{need / GiB:.1f} GiB needed of "
            f"{self.gpu_budget_bytes / GiB:.1f} GiB budget ({Fraction(TWO_POOL_SHARE).limit_denominator(100)} of {self.gpu_usable_bytes / GiB:.1f} GiB usable: weights and "
            f"activations sit in two allocator pools that do not share cached blocks; usable: {self.memory_fraction:.0%} "
            f"of {hw.gpu_memory_bytes / GiB:.1f} GiB"
            + (f" less {hw.reserved_gpu_bytes / GiB:.2f} GiB of CUDA context and workspaces" if hw.reserved_gpu_bytes else "")
            + "; needed: two stages' weights and gradients + one microbatch's activations)"
        )
        for reason in self.reasons:
            lines.append(f"  - {reason}")
        fitting = [a for a in self.advice if a.fits]
        if fitting:
            lines.append("Would fit with (each option alone; memory of the least-GPU-memory plan that fits):")
            lines += [f"  - {a.to_text()}" for a in fitting]
        if len(fitting) < len(self.advice):
            lines.append("Would not fit with any one of these alone (the least host and GPU memory each needs):")
            lines += [f"  - {a.to_text()}" for a in self.advice if not a.fits]
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


def fitting_recompute(costs: CostProfile, hardware: HardwareProfile, microbatches: int, *,
                      memory_fraction: float = DEFAULT_MEMORY_FRACTION, fused_last: bool = True,
                      host_budget_bytes: float | None = None) -> str | None:
    """The recompute grain a run with ``costs`` fits with: "stage" when one of the least-memory
    plans fits at stage grain (it costs no extra forward), else "layer" when one fits at layer
    grain, else None. ``host_budget_bytes``: the host RAM the state may use (default: all of it)."""
    for grain in ("stage", "layer"):
        if not fit_problems(costs, hardware, memory_fraction, microbatches, fused_last, grain,
                            host_budget_bytes=host_budget_bytes)[0]:
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
    host_headroom_bytes: int | None = None,
    host_memory_source: str = "",
    optimizer_undo: bool = True,
    quantize: str | None = None,
) -> TrainingPlan:
    """Decide whether training fits and recommend microbatches, a plan, the recompute grain and the longest sequence.

    ``microbatches`` fixes the count; by default 1, 2 and 4 per worker are tried. ``fused_last``
    (default on) assumes the model computes its own loss, as a Hugging Face causal LM given
    labels does, with the engine's chunked loss of ``loss_chunk_tokens`` rows (None: full
    logits). ``recompute``: "auto" (stage grain where it fits, else layer grain), "stage" or
    "layer". ``config`` tunes the simulations (default: 2 simulated steps, enough for the
    planner's comparisons, with the overlapped optimizer's failed-step undo journal priced at its
    default bound, as a GPU server runs it by default; its bytes are in the host figure too).

    Host: the state may use the RAM less ``host_headroom_bytes`` (default ``max(10%, 8 GiB)``,
    ``fit.host_headroom_bytes``); ``host_memory_source`` says where the RAM figure came from (default:
    the profile). ``optimizer_undo``: keep the failed-step undo copy (the engine's default).
    ``quantize``: "nf4" prices a 4-bit base (LoRA only, ``cost/quantization.py``). When the run does
    not fit, ``advice`` holds every option of ``planning/advice.py`` with its figures.
    """
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, got {recompute!r}")
    shape = get_model_shape(model)
    hw = load_hardware(hardware)
    headroom = host_headroom_bytes_of(hw.host_memory_bytes, host_headroom_bytes)
    host_budget = hw.host_memory_bytes - headroom
    cfg = config or SimConfig(steps=2, optimizer_undo=optimizer_undo, undo_journal_bytes=DEFAULT_UNDO_JOURNAL_BYTES)
    nw = hw.num_gpus
    options = [microbatches] if microbatches else [nw, 2 * nw, 4 * nw]
    costs = model_costs(shape, hw, seq_len, microbatch_size, lora_rank, loss_chunk_tokens, quantize)
    grains = ("stage", "layer") if recompute == "auto" else (recompute,)
    fit_kwargs = dict(host_budget_bytes=host_budget, optimizer_undo=optimizer_undo)
    for grain in grains:
        problems, host, min_gpu = fit_problems(costs, hw, memory_fraction, min(options), fused_last, grain, **fit_kwargs)
        choice = None
        if not problems:
            choice = best_plan(costs, hw, options, memory_fraction=memory_fraction, fused_last=fused_last,
                               config=cfg, host_budget_bytes=host_budget, recompute=grain, optimizer_undo=optimizer_undo)
            if choice is None:
                problems.append("no candidate plan fits both the worker and the host memory")
            else:
                host = host_bytes(costs, choice.plan, choice.microbatches, optimizer_undo)
        if not problems:
            break
    if problems and len(grains) > 1:  # neither fits: report stage grain's reasons, the default's
        grain = "stage"
        problems, host, min_gpu = fit_problems(costs, hw, memory_fraction, min(options), fused_last, grain, **fit_kwargs)
    report = TrainingPlan(shape, hw, seq_len, microbatch_size, lora_rank, memory_fraction, not problems, problems,
                          host, min_gpu, choice if not problems else None, recompute=grain,
                          loss_chunk_tokens=loss_chunk_tokens, host_memory_source=host_memory_source,
                          host_headroom_bytes=headroom, host_headroom_given=host_headroom_bytes is not None,
                          optimizer_undo=optimizer_undo, quantize=quantize)
    if problems:
        run = RunSettings(seq_len, microbatch_size, lora_rank, quantize, min(options), grains, optimizer_undo,
                          loss_chunk_tokens, memory_fraction, fused_last)
        report.advice = alternatives(shape, hw, run, host_budget)
    if find_max_seq_len:
        report.searched_max_seq = True
        kwargs = dict(microbatch_size=microbatch_size, lora_rank=lora_rank, microbatches=min(options),
                      loss_chunk_tokens=loss_chunk_tokens, memory_fraction=memory_fraction, fused_last=fused_last,
                      host_budget_bytes=host_budget, optimizer_undo=optimizer_undo, quantize=quantize)
        longest = longest_fitting_seq(shape, hw, recompute=grains[0], **kwargs)
        report.max_seq_len_stage_grain = longest if grains[0] == "stage" else None
        report.max_seq_recompute = grains[0]
        if len(grains) > 1:
            layer = longest_fitting_seq(shape, hw, recompute="layer", **kwargs)
            if layer is not None and (longest is None or layer > longest):
                longest, report.max_seq_recompute = layer, "layer"
        report.max_seq_len = longest
        if longest is not None:
            long_costs = model_costs(shape, hw, longest, microbatch_size, lora_rank, loss_chunk_tokens, quantize)
            report.max_seq_choice = best_plan(long_costs, hw, [min(options)], memory_fraction=memory_fraction,
                                              fused_last=fused_last, config=cfg, host_budget_bytes=host_budget,
                                              recompute=report.max_seq_recompute, optimizer_undo=optimizer_undo)
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
    host_headroom_bytes: int | None = None,
    optimizer_undo: bool = True,
    quantize: str | None = None,
) -> int | None:
    """Longest sequence (a multiple of 256 tokens, at most 1M) for which one of the least-memory plans
    (``least_memory_plans``) fits, with backward stages recomputed at ``recompute`` grain
    ("stage" or "layer"), within the host RAM less ``host_headroom_bytes`` (default as ``plan_training``)."""
    if recompute not in ("stage", "layer"):
        raise ValueError(f"recompute must be 'stage' or 'layer', got {recompute!r}")
    shape, hw = get_model_shape(model), load_hardware(hardware)
    budget = hw.host_memory_bytes - host_headroom_bytes_of(hw.host_memory_bytes, host_headroom_bytes)
    return longest_fitting_seq(shape, hw, microbatch_size=microbatch_size, lora_rank=lora_rank,
                               microbatches=microbatches or hw.num_gpus, loss_chunk_tokens=loss_chunk_tokens,
                               memory_fraction=memory_fraction, fused_last=fused_last, recompute=recompute,
                               host_budget_bytes=budget, optimizer_undo=optimizer_undo, quantize=quantize)


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

    return longest_multiple(fits, quantum, max_seq_len)
