"""Every option of RoundPipe, defined once.

The dataclasses here are the only definition of the options: ``RoundPipeStrategy``'s keyword
arguments are the fields of ``StrategyOptions``, ``RoundPipeRuntime`` takes
``RuntimeOptions``, the engine ``EngineOptions``, and the Hydra groups ``strategy``,
``partition`` and ``transfer`` under ``conf/`` extend the structured configs that
``register_configs`` stores in Hydra's ``ConfigStore`` (where Hydra is installed: the library itself
imports neither Hydra nor OmegaConf). Validation lives here too, and its
errors name the option as the caller spelled it: ``RoundPipeStrategy(timeout=nan)`` for a
strategy user, ``RuntimeOptions(timeout=nan)`` for a user of the Lightning-free runtime.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import os
import sys
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

from .cost.memory import DEFAULT_UNDO_JOURNAL_BYTES
from .errors import OptionError
from .schedule.dispatch_order import SCHEDULES
from .schedule.lowering import DEFAULT_PRIORITIES

PARTITION_POLICIES = ("compute", "params", "uniform", "auto", "manual")
RECOMPUTE_CHOICES = ("auto", "always", "layer", "never")
TRANSFER_KINDS = tuple(DEFAULT_PRIORITIES)  # the kinds a transfer priority is given for
PINNED_POLICIES = ("alloc", "register", "off")
BATCH_STATISTICS = ("refuse", "per_microbatch")
MOE_EXPERT_PATHS = ("hf", "grouped", "padded_bmm")


EARLY_STOP_NEEDS_COMPILE = ("the early-stopping recompute is a compiled graph: it needs compiled layers "
                            "(compile_layers=True; on the CPU backend layers run eagerly unless it is set)")


def _fail(owner: str, name: str, value: Any, rule: str):
    raise OptionError(f"{owner}({name}={value!r}): {rule}")


def _integer(owner: str, name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        _fail(owner, name, value, f"must be a whole number >= {minimum}" + (" or None" if allow_none else ""))


def _seconds(owner: str, name: str, value: Any, positive: bool = False, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
          and (value > 0 if positive else value >= 0))
    if not ok:
        _fail(owner, name, value, f"must be a finite number {'> 0' if positive else '>= 0'}" + (" or None" if allow_none else ""))


def _choice(owner: str, name: str, value: Any, choices) -> None:
    if value not in choices:
        _fail(owner, name, value, "use one of " + ", ".join(repr(c) for c in choices))


def _flag(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(owner, name, value, "must be True or False")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def overlap_optimizer_default(backend: str, num_workers: int, threads_per_worker: int = 1,
                              cores: int | None = None) -> bool:
    """``overlap_optimizer=None``'s rule: overlap only if a core is left for the optimizer thread.

    The pipeline keeps busy one core per worker thread (CPU backend: ``threads_per_worker``
    torch threads per worker; CUDA: the one thread that launches a GPU's kernels) plus the host
    thread that dispatches, accumulates and runs the loss. The overlapped optimizer's thread
    only pays when ``cores`` (default: this process's usable cores) exceed that; otherwise it
    slows the workers it shares cores with by more than it hides (measured: 2 CPU workers on 2
    cores ran at 0.69-0.86x of torch's 1F1B overlapped, 1.17x synchronous; issue 22)."""
    per_worker = threads_per_worker if backend == "cpu" else 1
    busy = num_workers * per_worker + 1
    return (usable_cores() if cores is None else cores) > busy


def plain(value: Any) -> Any:
    """A Hydra/OmegaConf container as plain dicts and lists (anything else unchanged). Only a process that
    imported OmegaConf can hold one, so the library never imports it itself."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is None:
        return value
    return omegaconf.OmegaConf.to_container(value, resolve=True) if omegaconf.OmegaConf.is_config(value) else value


@dataclass
class PartitionConfig:
    """How layers are cut into stages (Hydra group ``partition``).

    policy: "compute" (default: the plan the timing model predicts fastest from the estimated
        compute and transfer costs, an embedding priced as a gather and an LM head as a matmul,
        planned once at set-up, never re-planned: deterministic), "auto" (the same search, then
        re-planned from measured costs), "params" (equal weight bytes), "uniform" (equal layer
        counts) or "manual".
    forward_stages / backward_stages: stage counts for "uniform" and "params" (None: one forward
        stage per worker, two backward stages per worker).
    manual_forward / manual_backward: lists of [start, end) layer ranges for "manual"
        (manual_backward None: the forward ranges).
    replan_threshold: "auto" re-plans when measured costs move by more than this fraction.
    memory_budget_bytes: per-worker memory budget the stages are planned in (None: on CUDA, 4/7 of
        what the memory model lets tensors fill, 90% of the GPU's memory less its CUDA context,
        cuBLAS workspaces and allocator pages, as the upload and compute streams' allocator pools
        do not share cached memory; elsewhere ``cpu_memory_cap_bytes``, unlimited without one).
    """

    policy: str = "compute"
    forward_stages: Optional[int] = None
    backward_stages: Optional[int] = None
    manual_forward: Optional[list] = None
    manual_backward: Optional[list] = None
    replan_threshold: float = 0.2
    memory_budget_bytes: Optional[int] = None

    def validate(self, owner: str = "PartitionConfig", prefix: str = "") -> "PartitionConfig":
        """Check every field; errors name the option as ``owner`` and ``prefix`` spell it."""
        if self.policy not in PARTITION_POLICIES:
            _fail(owner, prefix + "policy", self.policy, "partition policy must be " + ", ".join(map(repr, PARTITION_POLICIES)))
        if self.policy == "manual" and not self.manual_forward:
            _fail(owner, prefix + "manual_forward", self.manual_forward,
                  "partition policy 'manual' needs manual_forward (and manual_backward) layer ranges")
        for name in ("forward_stages", "backward_stages"):
            _integer(owner, prefix + name, getattr(self, name), 1, allow_none=True)
        _seconds(owner, prefix + "replan_threshold", self.replan_threshold)
        _integer(owner, prefix + "memory_budget_bytes", self.memory_budget_bytes, 1, allow_none=True)
        return self


@dataclass
class TransferConfig:
    """Transfer priorities and the optional link model of the CPU backend (Hydra group ``transfer``).

    priorities: rank of each kind (lower first). Uploads are ordered by stage first, then by
        this rank: the running stage's inputs, then its weights, then the next stage's prefetch
        (which fills the gaps while inputs are not ready). Downloads by rank first: activations
        and input gradients other workers wait for before weight gradients.
    chunk_bytes: weight uploads and weight-gradient downloads are cut into chunks of about this size.
    prefetch_depth: stages a worker uploads ahead of the one it runs (1 keeps two resident).
    bandwidth_bytes_per_s / latency_s: CPU backend only: each transfer costs latency + bytes/bandwidth
        (25e9 models PCIe 4.0 x16); None means copies cost only the memory copy.
    queue: "priority" (each transfer queue picks the most urgent ready transfer) or "fifo" (one
        first-in-first-out queue per direction, like a bare CUDA stream: the baseline priorities beat).
    """

    priorities: dict = field(default_factory=lambda: dict(DEFAULT_PRIORITIES))
    chunk_bytes: int = 32 << 20
    prefetch_depth: int = 1
    bandwidth_bytes_per_s: Optional[float] = None
    latency_s: float = 0.0
    queue: str = "priority"

    def validate(self, owner: str = "TransferConfig", prefix: str = "") -> "TransferConfig":
        """Check every field; errors name the option as ``owner`` and ``prefix`` spell it."""
        if self.queue not in ("priority", "fifo"):
            _fail(owner, prefix + "queue", self.queue, "transfer queue must be 'priority' or 'fifo'")
        check_priorities(owner, prefix + "priorities", self.priorities)
        _integer(owner, prefix + "chunk_bytes", self.chunk_bytes, 1)
        _integer(owner, prefix + "prefetch_depth", self.prefetch_depth, 0)
        _seconds(owner, prefix + "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, positive=True, allow_none=True)
        _seconds(owner, prefix + "latency_s", self.latency_s)
        return self


def check_priorities(owner: str, name: str, priorities: Any) -> None:
    """Check that ``priorities`` gives a finite number for every transfer kind and nothing else."""
    if not isinstance(priorities, Mapping):
        _fail(owner, name, priorities, f"must map each of {list(TRANSFER_KINDS)} to a number")
    missing = sorted(set(TRANSFER_KINDS) - set(priorities))
    if missing:
        _fail(owner, name, priorities, f"priorities must give a number for {missing}")
    unknown = sorted(set(priorities) - set(TRANSFER_KINDS))
    if unknown:
        _fail(owner, name, priorities, f"unknown transfer kind(s) {unknown}; the kinds are {list(TRANSFER_KINDS)}")
    for kind, rank in priorities.items():
        if isinstance(rank, bool) or not isinstance(rank, numbers.Real) or not math.isfinite(rank):
            _fail(owner, name, priorities, f"the priority of {kind!r} must be a number (lower is served first), got {rank!r}")


@dataclass
class TestingOptions:
    """Delays injected on purpose, for tests and measurements: not for training (``testing=...``).

    They make a run slower or noisier so that tests see orderings a fast machine rarely shows,
    and so that measurements have a known compute time; the results stay exact and deterministic.

    compute_delay_s: CPU backend: sleep this long before each compute task.
    jitter_s: sleep a random time in [0, jitter_s) before each task of the CPU backend (compute
        and transfers) and before the stream work of the ``fake_cuda`` backend; its seed is ``seed``.
    optimizer_delay_s: sleep this long before each layer's overlapped optimizer step.
    """

    __test__ = False  # a name pytest would otherwise collect as a test class

    compute_delay_s: float = 0.0
    jitter_s: float = 0.0
    optimizer_delay_s: float = 0.0

    def validate(self, owner: str = "TestingOptions", prefix: str = "") -> "TestingOptions":
        """Check every delay is a finite number of seconds >= 0."""
        for name in ("compute_delay_s", "jitter_s", "optimizer_delay_s"):
            _seconds(owner, prefix + name, getattr(self, name))
        return self


# The flat names the testing knobs had before they moved into ``testing``: a call with one of
# them is refused with the new spelling.
MOVED_TO_TESTING = {"cpu_compute_delay_s": "compute_delay_s", "cpu_jitter_s": "jitter_s",
                    "optimizer_delay_s": "optimizer_delay_s"}


@dataclass
class EngineOptions:
    """How the engine runs a plan (what ``RuntimeOptions`` hands to ``PipelineEngine``).

    microbatches: number of microbatches a batch is split into (dim 0).
    recompute: True keeps only stage inputs in forward and recomputes in backward (bounded
        memory); False keeps each forward graph until backward (CPU backend only: its workers
        share memory) and needs backward stages cut like forward ones.
    layer_recompute: with ``recompute``, a backward (or fused) stage recomputes and
        back-propagates one layer at a time: it first runs its layers without grad keeping only
        each layer's input, then recomputes each layer with grad from the last to the first, so
        one layer's graph is alive instead of the whole stage's (one more forward of the stage).
    compute_dtype: dtype floating parameters are cast to on upload (None: as stored on host).
    compile_layers: run each layer through ``torch.compile`` on the workers (``engine/compiled_layers.py``).
    recompute_early_stop: with ``recompute`` and ``compile_layers``, the last layer of each backward
        stage (every layer, at layer grain) recomputes and back-propagates as one compiled vjp graph,
        which leaves out the forward work only its output needs (``engine/early_stop.py``).
    early_stop_required: with ``recompute_early_stop``, a layer the vjp cannot check (its forward does not
        run on meta tensors) fails the step (True, the option asked for explicitly); False (the option's
        default resolved on): that layer recomputes whole instead, as without the option.
    priorities, chunk_bytes, prefetch_depth: as in ``TransferConfig``.
    measure_tasks: keep every compute task's trace record until the step's measurements are
        read (``StepRun.measurements``, what the cost profile and the re-planner learn from),
        even when no timeline is recorded.
    """

    microbatches: int = 2
    recompute: bool = True
    layer_recompute: bool = False
    compute_dtype: Any = None
    compile_layers: bool = False
    recompute_early_stop: bool = False
    early_stop_required: bool = True
    priorities: dict = field(default_factory=lambda: dict(DEFAULT_PRIORITIES))
    chunk_bytes: int = 32 << 20
    prefetch_depth: int = 1
    measure_tasks: bool = True

    def validate(self, owner: str = "EngineOptions") -> "EngineOptions":
        """Check every field; errors name ``owner``."""
        _integer(owner, "microbatches", self.microbatches, 1)
        _flag(owner, "recompute", self.recompute)
        _flag(owner, "layer_recompute", self.layer_recompute)
        if self.layer_recompute and not self.recompute:
            _fail(owner, "layer_recompute", self.layer_recompute,
                  "layer-grain recompute is a way of recomputing: it needs recompute=True")
        _flag(owner, "measure_tasks", self.measure_tasks)
        _flag(owner, "compile_layers", self.compile_layers)
        _flag(owner, "recompute_early_stop", self.recompute_early_stop)
        _flag(owner, "early_stop_required", self.early_stop_required)
        if self.recompute_early_stop and not self.compile_layers:
            _fail(owner, "recompute_early_stop", self.recompute_early_stop, EARLY_STOP_NEEDS_COMPILE)
        check_priorities(owner, "priorities", self.priorities)
        _integer(owner, "chunk_bytes", self.chunk_bytes, 1)
        _integer(owner, "prefetch_depth", self.prefetch_depth, 0)
        return self


@dataclass
class RuntimeOptions:
    """Everything that decides how a module is pipelined, with or without Lightning.

    microbatches: microbatches per batch (None: the count the timing model predicts fastest
        for the plan, among 1, 2 and 4 per worker; the fewest within 2% of the fastest; see
        ``planning/defaults.py``).
    recompute: "auto" (default: "never" on the CPU backend when the forward graphs of a whole
        batch fit ``partition.memory_budget_bytes``, or half the host's memory without a budget;
        else "always"), "always" (keep stage inputs, recompute each stage in backward), "layer"
        (the same inputs kept, but a backward stage recomputes and back-propagates one layer at a
        time, so only one layer's graph is alive: for long sequences; costs one more forward of
        each backward stage) or "never" (keep forward graphs; CPU backend only; a second backward
        of one call recomputes).
    timeout: seconds any wait may take before it fails with an error naming what it waited for
        (seconds spent in ``torch.compile`` meanwhile do not count).
    partition: how layers are cut into stages (``PartitionConfig``).
    transfer: transfer priorities, chunking, prefetch and CPU link model (``TransferConfig``).
    compute_dtype: a ``torch.dtype`` weights are uploaded in (None: as stored). The strategy sets
        it from the precision plugin; no Hydra entry.
    compile_layers: run every layer through ``torch.compile`` (inductor) on the workers, so that its
        element-wise chains fuse into few kernels (``engine/compiled_layers.py``). One compile per
        layer class, grad mode and shape, reused by every layer, stage and worker of the process
        (a second shape compiles once more with dynamic dimensions, torch's automatic dynamic
        shapes); the first step pays it (measured on the CPU backend, 2 cores: tens of seconds for
        a tiny decoder layer, forward and backward), which no ``timeout`` counts and the step metrics'
        ``step_s`` leaves out (``host/compile_clock.py``). Exact within
        fp32 rounding of the eager path (summation order only, DESIGN's "exact by default");
        dropout draws the eager layer's numbers and recompute replays them. The causal LM's prefix
        (masks) and postfix (chunked loss) stay eager. None (default): the backend's rule
        (``WorkerPool.default_compile_layers``): on the CUDA backend when inductor can generate
        GPU code there (Triton installed, every GPU of compute capability 7.0 or newer), where the
        simulator predicts 11-30% more tokens/s on the reference workload (docs/tuning.md);
        eager on the CPU, fake-stream and emulated backends, whose tests and benchmarks stay eager.
        True: compile on any backend; False: eager layers.
    recompute_early_stop: the recompute of a backward stage's last layer (of every layer with
        recompute="layer") stops early: that layer's forward and backward run as one compiled
        ``torch.func.vjp`` graph, from which inductor drops the forward work whose result only
        the layer's output needs, a decoder layer's MLP down projection and residual add
        (``engine/early_stop.py``): 20-25% of its recompute FLOPs, 0.91x of the compiled
        recompute and backward measured on the CPU. Exact within fp32 rounding, as compiled layers;
        dropout replays exactly. Needs compiled layers (``compile_layers`` True, or None on a GPU
        backend that compiles); no effect without recompute. True: on, and a layer whose forward cannot be
        traced on meta tensors (Hugging Face's MoE expert loop: use ``moe_experts="grouped"``) fails the
        first step, changing no weight. The simulator prices the saving on the last layer of each backward stage
        (``analysis/own_engine.py``, ``Setup.early_stop``), and so does the planner (``StageCostModel``).
        None (default): on wherever layers run compiled (``compile_layers``' rule: on a GPU backend that
        compiles, or with ``compile_layers=True``), and a layer that cannot stop early there recomputes
        whole instead of failing. False: recompute whole layers.
    fp16_accumulation: fp16 matmuls accumulate in fp16 on CUDA, as the RoundPipe reference trains
        (``torch.backends.cuda.matmul.allow_fp16_accumulation``, turned on for the run and put back
        after it; ``workers/matmul_accumulation.py``): about twice the fp16 matmul rate of a GeForce
        GPU, NOT exact: each dot product rounds its running sum to fp16 (11-bit mantissa, range
        +-65504), see docs/tuning.md#precision. Needs fp16 compute (``precision="16-mixed"``, whose loss
        scaling keeps gradients in range); refused under any other precision. False (default):
        fp32 accumulation.
    cpu_threads_per_worker: CPU backend only: torch threads per worker's compute queue.
    cpu_reuse_freed_memory: CPU backend only: keep freed host memory in the process's allocator
        for the next step (glibc's mmap and trim thresholds raised to 1 GiB and its top pad to 64
        MiB, so that threads keep their emptied heaps; for the whole process and its life;
        ``host/host_allocator.py``), so that the large tensors every step allocates afresh
        (merged logits, the loss's log-softmax and gradient) do not page-fault on every first
        touch while the workers wait. Costs up to 1 GiB of freed memory kept. No effect where
        the C library is not glibc. False: glibc's own settings.
    cpu_memory_cap_bytes: CPU backend only: make each worker a virtual GPU of this many bytes.
        Its device memory is measured (uploaded weights and every tensor its tasks create, see
        ``workers/device_memory.py``) and a task that would take it over the cap fails with
        ``WorkerOutOfMemoryError`` naming worker, stage and microbatch; the step leaves weights
        and optimizer state as they were. None: no cap (and no measuring cost).
    seed: seed of the injected jitter (``testing.jitter_s``).
    trace_steps: keep the timeline of the first N training steps (for export).
    step_metrics: time every step's tasks for bubble fraction, exposed transfer and tokens per second.
    overlap_optimizer: step the optimizer layer by layer on a host thread, hidden behind backward
        (exact). False: the plain synchronous ``optimizer.step()``. None (default): overlap only
        where the host has a core to spare for that thread: when its usable cores exceed one per
        worker thread (CPU backend: ``cpu_threads_per_worker`` per worker; CUDA: one launching
        thread per GPU) plus one for the host thread (``overlap_optimizer_default``). On a
        2-core host with 2 CPU workers it does not overlap: the optimizer thread would take a
        core from a worker. ``staleness=1`` always overlaps.
    staleness: 0 (exact) or 1: RoundPipe's one-step-delayed update (the gradient of step t is
        taken at the weights from before update t-1): more overlap, NOT exact.
    pinned: pinned host memory policy for the CUDA backend: "alloc", "register" or "off" (see
        ``params/shadows.py`` for the trade-off); no effect on the CPU backend.
    allow_unverified: pipeline a Hugging Face family that is not verified (docs/models.md) after
        checking the pipelined against the unpipelined forward on the first microbatch.
    logits_with_loss: a Hugging Face causal LM called with ``labels`` also returns ``.logits``
        (costs the full logits; without it, reading them raises an error saying so).
    overlap_calls: with gradient accumulation, the next call's forward starts while the previous
        call's backward still drains (exact: the same weights and gradients, bit for bit). A
        backward that only accumulates (Lightning's ``accumulate_grad_batches`` before the last
        batch, or ``RoundPipeRuntime.returning_early``) returns once its stages are submitted;
        its weight gradients are added to ``.grad`` at the next pipelined call, optimizer step,
        ``join`` or checkpoint, and its failure raises there. Where something may read ``.grad``
        in between (an ``on_after_backward`` or ``on_train_batch_end``/``_start`` override,
        parameter hooks, an input needing a gradient, manual optimization) the backward waits,
        as with False. See docs/design.md, "Backward that returns early".
    optimizer_undo: a failed overlapped step puts back every layer it stepped (weights and
        optimizer state, from before-images kept in a bounded journal,
        ``optimizer_undo_journal_bytes``). False: no journal; a failed step raises naming the
        layers it updated, and training or saving the module is refused until a checkpoint is
        loaded (``fit(ckpt_path=...)``). Under fp16's loss scaler the journal is also what lets
        layers step during backward (an overflow puts them back); with False they step after
        backward, once every gradient is checked.
    optimizer_undo_journal_bytes: the most host bytes of before-images (parameters and their
        optimizer state, 12 per parameter under Adam) one step keeps for the undo (default
        4 GiB; None: no bound, a copy of every layer stepped). Layers past it (the lowest ones,
        when layers step during backward) do not step during backward: they wait until the step
        is known good (backward done, every gradient checked and reduced), then step without a
        copy. Every failure of the pipeline, the closure or a loss-scale check still leaves
        weights and optimizer state as before; only the optimizer's own update raising for such
        a layer cannot be put back (it is named, and training refuses until a checkpoint loads).
    batch_statistics: what a pipelined BatchNorm in training mode (or an InstanceNorm tracking
        running statistics) does with more than one microbatch. "refuse" (default): the call is
        refused before it runs, naming the layer (exact by default: use ``microbatches=1`` or eval
        mode). "per_microbatch": GPipe's semantics, NOT exact: each microbatch is normalised with
        its own statistics and the running statistics are updated once per microbatch, in
        microbatch order (``num_batches_tracked`` counts microbatches); see
        ``adapters/batch_statistics.py``.
    split_check: before the first pipelined call in each training mode, run every pipelined layer on
        the host (no grad, random state and the layers' state put back) on the rows of the first two
        microbatches, once whole and once per microbatch, and refuse, naming the layer, one whose
        output or state written in forward differs, or that replaces a buffer in forward
        (``engine/split_invariance.py``): batch-coupled layers of any kind, inputs whose batch is not
        dim 0, counters, power iterations, dynamic RoPE. Costs about two host forwards of those rows,
        once (docs/measurements.md). False: no check (a layer of that kind then trains inexactly).
    schedule: the order stages are dispatched to workers in (``schedule/dispatch_order.py``):
        "round_robin" (each stage to the worker after the previous one's, and the next call goes
        on from where this one ended) or "sticky" (round-robin from worker 0 in every call, so a
        stage always runs on the same worker).
    moe_experts: how a Hugging Face MoE model's experts run: "hf" (default: the model's own experts
        forward, as ``config._experts_implementation`` chose: transformers 5 picks its grouped_mm
        path where it can, "eager" is the per-expert loop, a host sync per expert) or "grouped"
        (``adapters/grouped_experts.py``: pairs sorted by expert, one grouped matmul per projection,
        no host sync; exact against HF's loop; parameters and ``state_dict`` unchanged; an experts
        layout it does not map, and any unverified family, keeps HF's forward, with a warning naming it)
        or "padded_bmm" (the same swap; the sorted pairs padded to the busiest expert's count, read once
        on the host per layer call, and one ``torch.bmm`` per projection: takes fp16 and honours
        ``fp16_accumulation``, where ``grouped_mm`` is bf16 only; exact against HF's loop, the empty
        slots adding exact zeros to the gradients; it computes ``experts x capacity`` rows, not ``pairs``).
    gc_freeze: while the runtime is attached, the objects Python's garbage collector tracks at attach
        (hundreds of thousands from torch, Lightning and transformers) sit in its permanent generation
        (``gc.freeze``, put back by ``gc.unfreeze`` when the last runtime detaches;
        ``host/host_gc.py``). Full collections, which hold the interpreter lock and so stop every
        lane, then scan only what training creates: 210 ms down to 1.4 ms each in the measured case
        (docs/measurements.md section 11). Cyclic garbage that exists at attach is freed only after
        detach. Left alone if something else froze objects first. False: the collector as it is.
    testing: delays injected for tests and measurements (``TestingOptions``); none by default.
    """

    microbatches: Optional[int] = None
    recompute: str = "auto"
    timeout: float = 300.0
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    compute_dtype: Any = None
    compile_layers: Optional[bool] = None
    recompute_early_stop: Optional[bool] = None
    fp16_accumulation: bool = False
    cpu_threads_per_worker: int = 1
    cpu_reuse_freed_memory: bool = True
    cpu_memory_cap_bytes: Optional[int] = None
    seed: int = 0
    trace_steps: int = 0
    step_metrics: bool = True
    overlap_optimizer: Optional[bool] = None
    staleness: int = 0
    pinned: str = "alloc"
    allow_unverified: bool = False
    logits_with_loss: bool = False
    overlap_calls: bool = True
    optimizer_undo: bool = True
    optimizer_undo_journal_bytes: Optional[int] = DEFAULT_UNDO_JOURNAL_BYTES
    batch_statistics: str = "refuse"
    split_check: bool = True
    schedule: str = "round_robin"
    moe_experts: str = "hf"
    gc_freeze: bool = True
    testing: TestingOptions = field(default_factory=TestingOptions)

    def validate(self, owner: str | None = None) -> "RuntimeOptions":
        """Check every field; ``owner`` is how the caller spelled the options (default: the class name)."""
        owner = owner or type(self).__name__
        self.partition = _nested(PartitionConfig, self.partition, owner, "partition").validate(owner, "partition.")
        self.transfer = _nested(TransferConfig, self.transfer, owner, "transfer").validate(owner, "transfer.")
        _integer(owner, "microbatches", self.microbatches, 1, allow_none=True)
        _choice(owner, "recompute", self.recompute, RECOMPUTE_CHOICES)
        _seconds(owner, "timeout", self.timeout, positive=True)
        self.testing = _nested(TestingOptions, self.testing, owner, "testing").validate(owner, "testing.")
        _integer(owner, "cpu_threads_per_worker", self.cpu_threads_per_worker, 1)
        _flag(owner, "cpu_reuse_freed_memory", self.cpu_reuse_freed_memory)
        _integer(owner, "cpu_memory_cap_bytes", self.cpu_memory_cap_bytes, 1, allow_none=True)
        _integer(owner, "seed", self.seed, 0)
        _integer(owner, "trace_steps", self.trace_steps, 0)
        _flag(owner, "step_metrics", self.step_metrics)
        if self.compile_layers is not None:
            _flag(owner, "compile_layers", self.compile_layers)
        if self.recompute_early_stop is not None:
            _flag(owner, "recompute_early_stop", self.recompute_early_stop)
        if self.recompute_early_stop and self.compile_layers is False:
            _fail(owner, "recompute_early_stop", self.recompute_early_stop, EARLY_STOP_NEEDS_COMPILE)
        _flag(owner, "fp16_accumulation", self.fp16_accumulation)
        if self.overlap_optimizer is not None:
            _flag(owner, "overlap_optimizer", self.overlap_optimizer)
        _flag(owner, "allow_unverified", self.allow_unverified)
        _flag(owner, "logits_with_loss", self.logits_with_loss)
        _flag(owner, "optimizer_undo", self.optimizer_undo)
        _integer(owner, "optimizer_undo_journal_bytes", self.optimizer_undo_journal_bytes, 0, allow_none=True)
        _flag(owner, "overlap_calls", self.overlap_calls)
        _flag(owner, "gc_freeze", self.gc_freeze)
        _flag(owner, "split_check", self.split_check)
        if self.staleness not in (0, 1) or isinstance(self.staleness, bool):
            _fail(owner, "staleness", self.staleness, "use 0 (exact) or 1 (one-step-delayed update)")
        if self.staleness and self.overlap_optimizer is False:
            _fail(owner, "staleness", self.staleness,
                  "staleness=1 is a mode of the overlapped optimizer: keep overlap_optimizer=True (or None)")
        _choice(owner, "pinned", self.pinned, PINNED_POLICIES)
        _choice(owner, "batch_statistics", self.batch_statistics, BATCH_STATISTICS)
        _choice(owner, "schedule", self.schedule, tuple(SCHEDULES))
        _choice(owner, "moe_experts", self.moe_experts, MOE_EXPERT_PATHS)
        return self

    def overlaps_optimizer(self, backend: str, num_workers: int, cores: int | None = None) -> bool:
        """Whether the optimizer is overlapped: ``overlap_optimizer`` when set, else its default
        rule on this host (``overlap_optimizer_default``); staleness=1 always overlaps."""
        if self.overlap_optimizer is not None:
            return self.overlap_optimizer
        if self.staleness:
            return True
        return overlap_optimizer_default(backend, num_workers, self.cpu_threads_per_worker, cores)

    def compiles_layers(self, backend_default: bool) -> bool:
        """Whether layers run compiled: ``compile_layers`` when set, else ``backend_default`` (the
        pool class's ``default_compile_layers()``)."""
        return bool(backend_default) if self.compile_layers is None else self.compile_layers

    def engine_options(self, num_workers: int, microbatches: int | None = None,
                       recompute: bool | None = None, compile_layers: bool | None = None) -> EngineOptions:
        """The engine's share of these options. ``microbatches`` / ``recompute`` / ``compile_layers``:
        the choices made for ``None`` / "auto" / ``None`` (the plan keeper and the backend make them);
        without them, one more microbatch than workers, recompute unless "never", and eager layers
        unless ``compile_layers=True``. ``recompute_early_stop`` None follows the layers: on where they run
        compiled, a layer that cannot stop early recomputing whole (``early_stop_required`` False)."""
        t = self.transfer
        microbatches = microbatches or self.microbatches or num_workers + 1
        recompute = self.recompute != "never" if recompute is None else recompute
        compiled = self.compiles_layers(False) if compile_layers is None else compile_layers
        return EngineOptions(microbatches=microbatches, recompute=recompute,
                             layer_recompute=recompute and self.recompute == "layer",
                             compute_dtype=self.compute_dtype,
                             compile_layers=compiled,
                             recompute_early_stop=compiled if self.recompute_early_stop is None
                             else self.recompute_early_stop,
                             early_stop_required=self.recompute_early_stop is True,
                             priorities=dict(t.priorities),
                             chunk_bytes=t.chunk_bytes, prefetch_depth=t.prefetch_depth)


@dataclass
class StrategyOptions(RuntimeOptions):
    """The keyword arguments of ``RoundPipeStrategy``: the runtime's options plus those about Lightning.

    module: dotted attribute path of the module to pipeline (None: found automatically).
    workers: expected number of workers; must equal the Trainer's ``devices`` when given.
    trace_dir: where the timeline of ``trace_steps`` goes (None: the trainer's ``default_root_dir``);
        checked writable before training starts.
    checkpoint_weights: "full" (the whole ``state_dict``, as Lightning's default strategy saves:
        resumable under any strategy) or "trainable" (only trainable weights and buffers: the
        small LoRA checkpoint, whose frozen base comes from the model path).
    progress_bar_metrics: also show the ``roundpipe/*`` step and memory metrics (``step_metrics``)
        in the progress bar; False (default): they reach the loggers only, and the progress bar
        keeps Lightning's figures and the job's one ``tokens_per_s``.
    log_step_metrics: log the ``roundpipe/*`` step and memory metrics to the Trainer's loggers
        (True, default). False keeps them out of your logger; ``step_metrics`` still measures them
        (``strategy.runtime.last_metrics`` during fit).
    verify_checkpoints: check every entry of a checkpoint against the CRC-32 stored in it before
        loading it, and refuse a changed file (``CheckpointIntegrityError`` naming the file). Off by
        default: it added 24% and 36% to a 1 GiB load in two runs here (0.82 s of CRC-32 on a 1.73 s load,
        0.45 s on 1.03 s; ``python -m benchmarks.calibration.checkpoint_integrity``), over the 5% a default may cost.
    """

    module: Optional[str] = None
    workers: Optional[int] = None
    trace_dir: Optional[str] = None
    checkpoint_weights: str = "full"
    progress_bar_metrics: bool = False
    log_step_metrics: bool = True
    verify_checkpoints: bool = False

    def validate(self, owner: str | None = None) -> "StrategyOptions":
        owner = owner or "RoundPipeStrategy"
        super().validate(owner)
        _integer(owner, "workers", self.workers, 1, allow_none=True)
        _choice(owner, "checkpoint_weights", self.checkpoint_weights, ("full", "trainable"))
        _flag(owner, "progress_bar_metrics", self.progress_bar_metrics)
        _flag(owner, "log_step_metrics", self.log_step_metrics)
        _flag(owner, "verify_checkpoints", self.verify_checkpoints)
        if self.module is not None and not isinstance(self.module, str):
            _fail(owner, "module", self.module, "give the dotted attribute path of the module to pipeline, e.g. 'model.net'")
        return self

    def runtime_options(self) -> RuntimeOptions:
        """The runtime's share of these options (all but those about Lightning)."""
        return RuntimeOptions(**{f.name: getattr(self, f.name) for f in fields(RuntimeOptions)})


def _nested(cls, value: Any, owner: str, option: str):
    """A nested option group given as the dataclass, a dict, a Hydra config or None (a policy name for
    partition)."""
    value = plain(value)
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and cls is PartitionConfig:
        return cls(policy=value)
    if isinstance(value, Mapping):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise OptionError(f"{owner}({option}=...): unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**value)
    raise OptionError(f"{owner}({option}=...) takes a {cls.__name__}, a dict or None, got {type(value).__name__}")


def strategy_options(owner: str = "RoundPipeStrategy", **values: Any) -> StrategyOptions:
    """Validated ``StrategyOptions`` from keyword arguments; an unknown keyword names the known ones."""
    known = {f.name for f in fields(StrategyOptions)} - {"compute_dtype"}
    moved = sorted(set(values) & set(MOVED_TO_TESTING))
    if moved:
        spelled = ", ".join(f"{MOVED_TO_TESTING[name]!r}: {values[name]!r}" for name in moved)
        raise TypeError(f"{owner}({moved[0]}=...): the testing knobs {moved} moved into the testing options: "
                        f"pass testing={{{spelled}}}")
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"{owner}() got unknown option(s) {unknown}; the options are {sorted(known)}")
    return StrategyOptions(**{k: plain(v) for k, v in values.items()}).validate(owner)


def option_keywords_signature(init) -> inspect.Signature:
    """``init``'s signature with its ``**options`` replaced by one keyword per ``StrategyOptions``
    field, with its default and its type, so ``help``, ``inspect``, Hydra and LightningCLI
    (jsonargparse reads this signature) see the real, typed arguments."""
    own = inspect.signature(init)
    hints = typing.get_type_hints(init)
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own.parameters.values()
              if p.kind is not inspect.Parameter.VAR_KEYWORD]
    defaults = StrategyOptions()
    option_types = typing.get_type_hints(StrategyOptions)
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, f.name),
                                 annotation=option_types[f.name])
               for f in fields(StrategyOptions) if f.name != "compute_dtype"]
    return own.replace(parameters=params, return_annotation=None)


# ---------------------------------------------------------------------- Hydra structured configs
def strategy_config_class():
    """The Hydra node of ``conf/strategy/roundpipe.yaml``: the strategy's options minus the groups
    ``partition`` and ``transfer`` (top-level Hydra groups of their own) and ``compute_dtype``
    (set from the Trainer's precision), plus ``_target_``."""
    skipped = {"partition", "transfer", "compute_dtype"}
    own = [(f.name, f.type, field(default=f.default) if f.default is not dataclasses.MISSING
            else field(default_factory=f.default_factory))
           for f in fields(StrategyOptions) if f.name not in skipped]
    target = ("_target_", str, field(default="lightning_roundpipe.RoundPipeStrategy"))
    return dataclasses.make_dataclass("RoundPipeStrategyConfig", [target, *own], namespace={"__module__": __name__})


def register_configs() -> bool:
    """Store the structured configs the YAML files under ``conf/`` extend (``defaults: [<name>, _self_]``);
    False, storing nothing, where Hydra or OmegaConf cannot be imported (a training run needs neither).

    ``strategy/roundpipe_schema``, ``partition/partition_schema`` (``manual_partition_schema`` for
    ``policy: manual``, whose ranges are required) and ``transfer/transfer_schema``:
    Hydra then checks types and rejects unknown keys when it composes the job's config.
    """
    try:
        from hydra.core.config_store import ConfigStore
        from omegaconf import OmegaConf
    except ImportError:  # the fine-tuning job's dependencies, not the library's
        return False

    store = ConfigStore.instance()
    store.store(group="strategy", name="roundpipe_schema", node=strategy_config_class())
    store.store(group="partition", name="partition_schema", node=PartitionConfig)
    # policy=manual: the layer ranges are required (Hydra's "???"), which a merge onto None would drop
    store.store(group="partition", name="manual_partition_schema",
                node=OmegaConf.structured(PartitionConfig(policy="manual", manual_forward="???")))
    store.store(group="transfer", name="transfer_schema", node=TransferConfig)
    return True
