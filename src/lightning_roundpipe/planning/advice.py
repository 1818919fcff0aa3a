"""What would make a run that does not fit fit: each option alone, with the memory it would need.

The options, each changed alone from the run asked about: ``optimizer_undo=False`` (no failed-step
copy), LoRA, a 4-bit NF4 base (QLoRA), LoRA on the attention only (an MoE model whose adapters cover
every expert), fewer microbatches per step, layer-grain recompute, shorter sequences, and one
sequence per microbatch. Each is checked as ``fit_problems`` checks the run (the
least-memory plans, fast: no simulation), so its figures are the least that option needs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..cost.hardware import HardwareProfile
from ..cost.transformer import ModelShape
from .fit import fit_problems, longest_fitting_seq, model_costs

GiB = 2**30
ADVISED_LORA_RANK = 16  # the rank advised for a full fine-tuning run that does not fit


@dataclass(frozen=True)
class RunSettings:
    """What a planned run is: the knobs the advice turns one at a time."""

    seq_len: int
    microbatch_size: int
    lora_rank: int | None
    quantize: str | None
    microbatches: int
    recompute_grains: tuple[str, ...]  # the grains the verdict may use ("stage", "layer")
    optimizer_undo: bool
    loss_chunk_tokens: int | None
    memory_fraction: float
    fused_last: bool


@dataclass(frozen=True)
class Alternative:
    """One option, what it would need, and whether that fits."""

    option: str  # as the user sets it
    host_bytes: int  # least host memory needed with it
    gpu_bytes: int  # least GPU memory per worker with it
    fits: bool
    note: str = ""

    def to_text(self) -> str:
        """One line: the option, its figures, and what it costs."""
        return (f"{self.option}: host {self.host_bytes / GiB:.1f} GiB, GPU {self.gpu_bytes / GiB:.1f} GiB per worker"
                + (f" ({self.note})" if self.note else ""))


def _check(shape: ModelShape, hw: HardwareProfile, run: RunSettings, host_budget: float) -> tuple[bool, int, int]:
    costs = model_costs(shape, hw, run.seq_len, run.microbatch_size, run.lora_rank, run.loss_chunk_tokens, run.quantize)
    first = None
    for grain in run.recompute_grains:
        problems, host, gpu = fit_problems(costs, hw, run.memory_fraction, run.microbatches, run.fused_last, grain,
                                           host_budget_bytes=host_budget, optimizer_undo=run.optimizer_undo)
        if not problems:
            return True, host.total, gpu
        first = first or (host.total, gpu)
    return False, *first


def alternatives(shape: ModelShape, hw: HardwareProfile, run: RunSettings, host_budget: float) -> list[Alternative]:
    """Every option of the module doc that applies to ``run``, each alone, with its figures."""
    options: list[tuple[str, RunSettings, str]] = []
    shapes: dict[str, ModelShape] = {}  # options that change the model's LoRA targets
    if run.optimizer_undo:
        options.append(("optimizer_undo=False", replace(run, optimizer_undo=False),
                        "a failed step is no longer undone: resume from a checkpoint"))
    if not run.lora_rank:
        options.append((f"LoRA rank {ADVISED_LORA_RANK} (--lora-rank {ADVISED_LORA_RANK})",
                        replace(run, lora_rank=ADVISED_LORA_RANK), "adapters train, the base is frozen"))
    if not run.quantize:
        rank = run.lora_rank or ADVISED_LORA_RANK
        options.append((f"a 4-bit NF4 base with LoRA rank {rank} (--quantize nf4 --lora-rank {rank})",
                        replace(run, quantize="nf4", lora_rank=rank), "QLoRA"))
    if run.lora_rank and shape.is_moe and shape.lora_on_mlp:
        option = "LoRA on the attention only (--lora-targets attention)"
        options.append((option, run, "no adapters on the experts"))
        shapes[option] = replace(shape, lora_targets="attention")
    if "layer" not in run.recompute_grains:
        options.append(("recompute='layer' (--recompute layer)", replace(run, recompute_grains=("layer",)),
                        "one more forward per backward stage"))
    if run.microbatch_size > 1:
        options.append(("microbatch size 1 (--microbatch-size 1)", replace(run, microbatch_size=1),
                        "fewer tokens per step"))
    found: list[Alternative] = []
    for option, settings, note in options:
        fits, host, gpu = _check(shapes.get(option, shape), hw, settings, host_budget)
        found.append(Alternative(option, host, gpu, fits, note))
    for m in range(run.microbatches - 1, 0, -1):  # the most microbatches that fit (saved inputs scale with them)
        fits, host, gpu = _check(shape, hw, replace(run, microbatches=m), host_budget)
        if fits or m == 1:
            found.append(Alternative(f"{m} microbatch{'' if m == 1 else 'es'} per step (--microbatches {m})", host, gpu, fits,
                                     "fewer tokens per step: accumulate gradients to keep the batch"))
            break
    longest = max((longest_fitting_seq(shape, hw, microbatch_size=run.microbatch_size, lora_rank=run.lora_rank,
                                       microbatches=run.microbatches, loss_chunk_tokens=run.loss_chunk_tokens,
                                       memory_fraction=run.memory_fraction, fused_last=run.fused_last,
                                       recompute=grain, host_budget_bytes=host_budget,
                                       optimizer_undo=run.optimizer_undo, quantize=run.quantize) or 0
                   for grain in run.recompute_grains), default=0)
    if 0 < longest < run.seq_len:
        fits, host, gpu = _check(shape, hw, replace(run, seq_len=longest), host_budget)
        found.append(Alternative(f"sequences of {longest} tokens (--seq-len {longest})", host, gpu, fits,
                                 "the longest that fits"))
    return found
