"""The reference RoundPipe benchmark's workload, simulated: calls per step, stale or synchronous optimizer.

The published runs (8x RTX 4090, 2048 tokens, fp16 accumulation, full fine-tuning) run ``calls``
forward-backward calls of ``microbatches`` microbatches per optimizer step, with the optimizer
one step stale (RoundPipe) or synchronous (RoundPipe-sync). ``simulate_workload`` times that on
the simulator; tokens/s is tokens per optimizer step over the steady period. Details:
docs/design.md, design notes, ``analysis/workload.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_roundpipe.cost.transformer import get_model_shape, shape_layer_costs
from lightning_roundpipe.planning.capacity import best_plan
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.cost.hardware import HardwareProfile, load_hardware
from lightning_roundpipe.sim.simulate import SimConfig, SimResult, simulate_roundpipe


@dataclass(frozen=True)
class Workload:
    """Per optimizer step: ``calls`` forward-backward calls of ``microbatches`` microbatches each.

    ``sequences_per_step`` sequences of ``seq_len`` tokens, split evenly over calls and
    microbatches (a microbatch may hold a fractional average number of sequences).
    ``optimizer``: ``"stale"`` (one step stale, overlapped) or ``"sync"`` (not overlapped).
    ``fp16_accumulation``: matmuls run at the fp16-accumulate tensor rate.
    """

    sequences_per_step: int
    microbatches: int
    calls: int
    seq_len: int = 2048
    optimizer: str = "stale"
    fp16_accumulation: bool = True
    # Tokens per chunk of the cross-entropy: a microbatch of 12.8 sequences has 40 GB of fp32
    # logits at Qwen3's vocabulary, so the published runs (24 GB GPUs) cannot have materialised
    # them whole; one sequence at a time is assumed.
    loss_chunk_tokens: int | None = 2048
    lora_rank: int | None = None  # LoRA of this rank on every linear layer but the router (None: full)
    # How MoE experts run (cost/moe_loop.py): the reference's own per-expert loop, as it was measured.
    moe_dispatch: str | None = "reference_loop"
    # The reference's recompute grain: "stage", or "layer" (each layer's input kept by the forward,
    # downloaded to the host, so the backward runs no extra pass; SimConfig.layer_inputs_from_forward).
    recompute: str = "stage"

    def __post_init__(self) -> None:
        if min(self.sequences_per_step, self.microbatches, self.calls, self.seq_len) < 1:
            raise ValueError(f"a workload needs positive sizes, got {self}")
        if self.optimizer not in ("stale", "sync"):
            raise ValueError(f"optimizer must be 'stale' or 'sync', got {self.optimizer!r}")
        if self.recompute not in ("stage", "layer"):
            raise ValueError(f"recompute must be 'stage' or 'layer', got {self.recompute!r}")

    @property
    def sequences_per_microbatch(self) -> float:
        """Sequences in one microbatch of one call."""
        return self.sequences_per_step / (self.calls * self.microbatches)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on."""
        return self.sequences_per_step * self.seq_len

    def sim_config(self, optimizer_steps: int = 3) -> SimConfig:
        """Simulator options of this workload over ``optimizer_steps`` optimizer steps."""
        # The reference dispatches each call's stages as their inputs become ready and the next
        # call without waiting for this one's backward to return (event-based synchronisation):
        # no host barriers.
        return SimConfig(steps=self.calls * optimizer_steps, accumulation=self.calls,
                         stale_optimizer=self.optimizer == "stale", optimizer_barrier=self.optimizer == "sync",
                         host_barriers=False, layer_recompute=self.recompute == "layer",
                         layer_inputs_from_forward=self.recompute == "layer")


@dataclass(frozen=True)
class PublishedRun:
    """One model's row of the reference benchmark: both workloads and the measured tokens/s."""

    model: str
    stale: Workload
    sync: Workload
    measured_stale: float
    measured_sync: float


def _run(model: str, sequences: int, calls: int, sync_calls: int, stale_tps: float, sync_tps: float) -> PublishedRun:
    # RoundPipe-sync keeps the step's sequences and splits them over more, smaller calls
    # (``train-sync.py <model> <batch> 2048 10 <accumulation>`` in the artifact's run.sh).
    return PublishedRun(model, Workload(sequences, 10, calls), Workload(sequences, 10, sync_calls, optimizer="sync"),
                        stale_tps, sync_tps)


# The reference implementation's published benchmark on 8x RTX 4090: tokens/s, 10 steps after 5
# warm-up (github.com/ITcarrot/RoundPipe-artifact: roundpipe/run.sh for the workloads,
# exp/raw-data.csv for the figures).
PUBLISHED_RUNS = (
    _run("qwen3-1.7b", 512, 4, 7, 65_417, 56_489),
    _run("llama-3.1-8b", 256, 2, 5, 24_275, 18_888),
    _run("qwen3-32b", 128, 2, 2, 5_516, 4_164),
)


# The reference's own stage partitions of these models (decoder layers per forward stage | per
# backward stage, the first backward stage holding the LM head alone), from the artifact's
# pp-simulate/run.sh ("roundpipe|<model>" STAGE_PARTITION).
REFERENCE_PARTITIONS = {
    "qwen3-1.7b": ((7, 7, 7, 7), (0,) + (3,) * 8 + (2, 2)),
    "llama-3.1-8b": ((5, 5, 5, 5, 6, 6), (0,) + (2,) * 16),
    "qwen3-32b": ((2, 2) + (3,) * 20, (0,) + (1,) * 64),
    "gpt-oss-20b": ((4, 5, 5, 5, 5), (0,) + (1,) * 24),
    "qwen3-235b-a22b": ((2,) * 47, (0,) + (1,) * 94),
}


def reference_plan(model: str) -> Plan:
    """The reference's partition of ``model`` as a ``Plan`` of this project's layers.

    The pipelined model has the embedding first and the norm + LM head + loss last: the first
    forward and the last backward stage take the embedding with their decoder layers, and the
    head is the fused last stage (forward and backward of the loss in one task), as the
    reference runs it.
    """
    forward_counts, backward_counts = REFERENCE_PARTITIONS[model]
    decoders = sum(forward_counts)
    if sum(backward_counts) != decoders or backward_counts[0] != 0:
        raise ValueError(f"inconsistent reference partition for {model}")
    head = decoders + 1
    forward, start = [], 0
    for i, n in enumerate(forward_counts):
        end = start + n + (1 if i == 0 else 0)  # the embedding rides with the first stage
        forward.append((start, end))
        start = end
    forward.append((head, head + 1))
    backward, end = [], head
    for n in backward_counts[1:]:
        backward.append((end - n, end))
        end -= n
    a, b = backward[-1]
    backward[-1] = (0, b)  # the embedding's backward with the last backward stage
    backward = sorted(backward) + [(head, head + 1)]
    return Plan(head + 1, tuple(forward), tuple(backward), fused_last=True).validate()


@dataclass
class WorkloadResult:
    """Simulated optimizer steps of a workload."""

    workload: Workload
    step_s: float  # steady seconds per optimizer step
    call: SimResult  # the simulation (its step_s is per call)
    plan: Plan

    @property
    def tokens_per_s(self) -> float:
        """Trained tokens per second of the simulated step."""
        return self.workload.tokens_per_step / self.step_s


def optimizer_step_period(result: SimResult, calls: int) -> float:
    """Steady seconds between the ends of consecutive optimizer steps of ``calls`` calls each."""
    ends: dict[int, float] = {}
    for r in result.timeline:
        group = r.step // calls
        ends[group] = max(ends.get(group, 0.0), r.end)
    groups = sorted(ends)
    if len(groups) < 2:
        return ends[groups[0]]
    return (ends[groups[-1]] - ends[groups[0]]) / (len(groups) - 1)


def simulate_workload(model: str, hardware: str | HardwareProfile, workload: Workload, *, plan: Plan | None = None,
                      optimizer_steps: int = 3, config: SimConfig | None = None) -> WorkloadResult:
    """Simulate ``workload`` for a model preset; the plan defaults to the planner's best for one call."""
    hw = load_hardware(hardware)
    costs = shape_layer_costs(get_model_shape(model), hw, workload.seq_len, workload.sequences_per_microbatch,
                              lora_rank=workload.lora_rank, loss_chunk_tokens=workload.loss_chunk_tokens,
                              fp16_accumulation=workload.fp16_accumulation, moe_dispatch=workload.moe_dispatch)
    if plan is None:
        choice = best_plan(costs, hw, [workload.microbatches], fused_last=True)
        if choice is None:
            raise ValueError(f"{model} does not fit {hw.name} with {workload.sequences_per_microbatch:g} sequences "
                             f"per microbatch")
        plan = choice.plan
    cfg = workload.sim_config(optimizer_steps)
    if config is not None:
        cfg = replace(config, steps=cfg.steps, accumulation=cfg.accumulation, stale_optimizer=cfg.stale_optimizer,
                      optimizer_barrier=cfg.optimizer_barrier)
    result = simulate_roundpipe(plan, costs, hw, workload.microbatches, config=cfg)
    return WorkloadResult(workload, optimizer_step_period(result, workload.calls), result, plan)
