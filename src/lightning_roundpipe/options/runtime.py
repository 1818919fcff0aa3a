"""``RuntimeOptions``: everything a user sets about how a module is pipelined, checked once.

Frozen and validated when constructed, its errors naming the option as the caller spelled it
(``OWNER``: ``RuntimeOptions``, or ``RoundPipeStrategy`` for the strategy's subclass). The parts
of the runtime get their share as frozen sub-configs built here: ``engine_options``,
``keeper_config`` and ``overlap_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from ..cost.memory import DEFAULT_UNDO_JOURNAL_BYTES
from ..schedule.dispatch_order import SCHEDULES
from ..option_checks import choice, fail, flag, nested_group, seconds, whole_number
from ..optim.overlap_config import OverlapConfig
from ..planning.keeper_config import KeeperConfig
from ..schedule.step_options import EARLY_STOP_NEEDS_COMPILE, EngineOptions
from .groups import PartitionConfig, TestingOptions, TransferConfig
from .overlap_rule import overlap_optimizer_default

RECOMPUTE_CHOICES = ("auto", "always", "layer", "never")
PINNED_POLICIES = ("alloc", "register", "off")
BATCH_STATISTICS = ("refuse", "per_microbatch")
MOE_EXPERT_PATHS = ("hf", "grouped", "padded_bmm")


def partition_named(policy: str) -> PartitionConfig:
    """``partition="auto"``: the group with that policy and every other field at its default."""
    return PartitionConfig(policy=policy)


@dataclass(frozen=True)
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

    OWNER: ClassVar[str] = "RuntimeOptions"  # how errors name these options

    def __post_init__(self) -> None:
        """The nested groups as their dataclasses (from a dict, a Hydra config, None or a policy's name),
        then every field checked: a constructed options object is a valid one."""
        groups = {"partition": (PartitionConfig, partition_named), "transfer": (TransferConfig, None),
                  "testing": (TestingOptions, None)}
        for name, (cls, from_text) in groups.items():
            object.__setattr__(self, name, nested_group(cls, getattr(self, name), self.OWNER, name, from_text))
        self.validate()

    def validate(self, owner: str | None = None) -> "RuntimeOptions":
        """Check every field (done at construction); ``owner`` is how the caller spelled the options
        (default: ``OWNER``)."""
        owner = owner or self.OWNER
        self.partition.validate(owner, "partition.")
        self.transfer.validate(owner, "transfer.")
        whole_number(owner, "microbatches", self.microbatches, 1, allow_none=True)
        choice(owner, "recompute", self.recompute, RECOMPUTE_CHOICES)
        seconds(owner, "timeout", self.timeout, positive=True)
        self.testing.validate(owner, "testing.")
        whole_number(owner, "cpu_threads_per_worker", self.cpu_threads_per_worker, 1)
        flag(owner, "cpu_reuse_freed_memory", self.cpu_reuse_freed_memory)
        whole_number(owner, "cpu_memory_cap_bytes", self.cpu_memory_cap_bytes, 1, allow_none=True)
        whole_number(owner, "seed", self.seed, 0)
        whole_number(owner, "trace_steps", self.trace_steps, 0)
        flag(owner, "step_metrics", self.step_metrics)
        if self.compile_layers is not None:
            flag(owner, "compile_layers", self.compile_layers)
        if self.recompute_early_stop is not None:
            flag(owner, "recompute_early_stop", self.recompute_early_stop)
        if self.recompute_early_stop and self.compile_layers is False:
            fail(owner, "recompute_early_stop", self.recompute_early_stop, EARLY_STOP_NEEDS_COMPILE)
        flag(owner, "fp16_accumulation", self.fp16_accumulation)
        if self.overlap_optimizer is not None:
            flag(owner, "overlap_optimizer", self.overlap_optimizer)
        flag(owner, "allow_unverified", self.allow_unverified)
        flag(owner, "logits_with_loss", self.logits_with_loss)
        flag(owner, "optimizer_undo", self.optimizer_undo)
        whole_number(owner, "optimizer_undo_journal_bytes", self.optimizer_undo_journal_bytes, 0, allow_none=True)
        flag(owner, "overlap_calls", self.overlap_calls)
        flag(owner, "gc_freeze", self.gc_freeze)
        flag(owner, "split_check", self.split_check)
        if self.staleness not in (0, 1) or isinstance(self.staleness, bool):
            fail(owner, "staleness", self.staleness, "use 0 (exact) or 1 (one-step-delayed update)")
        if self.staleness and self.overlap_optimizer is False:
            fail(owner, "staleness", self.staleness,
                  "staleness=1 is a mode of the overlapped optimizer: keep overlap_optimizer=True (or None)")
        choice(owner, "pinned", self.pinned, PINNED_POLICIES)
        choice(owner, "batch_statistics", self.batch_statistics, BATCH_STATISTICS)
        choice(owner, "schedule", self.schedule, tuple(SCHEDULES))
        choice(owner, "moe_experts", self.moe_experts, MOE_EXPERT_PATHS)
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
                             chunk_bytes=t.chunk_bytes, prefetch_depth=t.prefetch_depth, schedule=self.schedule)

    def keeper_config(self, backend_class, device_indices=None) -> KeeperConfig:
        """The plan keeper's share, with what the backend (``backend_class``, a ``WorkerPool`` class)
        assumes where the options leave it open: the link and compute rates, the memory budget and
        the option the budget is named by, the device the planner prices, the per-microbatch cost."""
        p, t = self.partition, self.transfer
        own_budget = p.memory_budget_bytes is not None
        return KeeperConfig(
            microbatches=self.microbatches, partition=p, recompute=self.recompute, compute_dtype=self.compute_dtype,
            link_bytes_per_second=t.bandwidth_bytes_per_s or backend_class.assumed_link_bytes_per_s,
            flops_per_second=backend_class.assumed_flops_per_s,
            memory_budget_bytes=p.memory_budget_bytes or backend_class.memory_budget_bytes(device_indices, self),
            budget_option="partition.memory_budget_bytes" if own_budget else backend_class.budget_option,
            backend=backend_class.planner_device, microbatch_overhead_s=backend_class.microbatch_overhead_s)

    def overlap_config(self, early_steps: bool = True, undo: bool | None = None,
                       delay_per_layer_s: float | None = None) -> OverlapConfig:
        """An overlapped optimizer's share; ``undo`` and ``delay_per_layer_s`` None: ``optimizer_undo``
        and ``testing.optimizer_delay_s``."""
        return OverlapConfig(
            staleness=self.staleness, early_steps=early_steps, timeout_s=float(self.timeout),
            delay_per_layer_s=float(self.testing.optimizer_delay_s if delay_per_layer_s is None else delay_per_layer_s),
            undo=bool(self.optimizer_undo if undo is None else undo), journal_bytes=self.optimizer_undo_journal_bytes)
