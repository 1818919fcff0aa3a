"""Puts the parts together for one pipelined module: layers, pool, plan, engine, patched forward.

Free of Lightning, so the same set-up serves the strategy and plain PyTorch users:

    runtime = RoundPipeRuntime.attach(model.net, backend="cpu", num_workers=2)
    optimizer = runtime.overlap_optimizer(torch.optim.AdamW(model.parameters()))  # optional
    loss = loss_fn(model.net(x), y); loss.backward()   # pipelined forward and backward
    optimizer.step()                                   # layer by layer, behind the next forward
    runtime.join()                                     # before reading the weights directly
    runtime.detach()
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from .options import OptionError, RuntimeOptions
from .workers.matmul_accumulation import Fp16Accumulation
from .host.host_gc import OlderObjectsFrozen
from .host.host_heap import TRIM_EVERY_STEPS, return_free_heap
from .engine import PipelineEngine
from .engine.buffers import expect_buffer_writes
from .engine.rng import CPU_GENERATOR
from .engine.microbatch import MicrobatchError, batch_size_of, register_batch_types
from .engine.forward_hooks import HookGuard
from .engine.split_invariance import SplitInvarianceCheck
from .params.packed import cpu_inference_4bit_modules, upload_parts
from .schedule.plan import PlanError
from .planning.keeper import PlanKeeper
from .adapters.batch_statistics import BatchStatistics
from .adapters.target import STACK_KINDS, ParameterHomes, locate, patch_forward, unpatch
from .setup_progress import ProgressCallback
from .tracing.records import TraceRecorder
from .workers import backend_class, make_pool
from .host.compile_clock import COMPILE_CLOCK

log = logging.getLogger("lightning_roundpipe")

__all__ = ["RoundPipeRuntime", "RuntimeOptions", "run_all"]

# Modules a failed step left partly updated (optimizer_undo=False), until their weights are
# restored: the refusal outlives the runtime, so a new attach cannot train on from that state.
_partly_updated: "weakref.WeakKeyDictionary[nn.Module, list[str]]" = weakref.WeakKeyDictionary()


class RoundPipeRuntime:
    """A module pipelined over a worker pool, with the host state that serves it; ``detach`` restores it.

    The runtime owns everything the pipeline adds around the module: the pool, the engine, the
    compute-dtype shadows and pinned memory (per ``options.pinned``), the overlapped optimizers,
    and, with ``sync_gradients``, the all-reduce of gradients across processes.
    """

    def __init__(self, module: nn.Module, layers: list[nn.Module], forward: Callable[["RoundPipeRuntime"], Callable],
                 backend: str, num_workers: int, options: RuntimeOptions, fused_last: bool = False,
                 device_indices=None, trace: TraceRecorder | None = None, sync_gradients: bool = False,
                 root_module: nn.Module | None = None, options_owner: str | None = None,
                 progress: ProgressCallback | None = None):
        self.module = module
        self.root = root_module or module
        self.layers = layers
        self.options = options  # validated when constructed (frozen)
        self.refuse_if_partly_updated(self.root, "train")
        self.parameter_homes = ParameterHomes(self.root)  # put back at detach (peft target_parameters)
        self.batch_statistics = BatchStatistics(layers, self.options.batch_statistics,
                                                options_owner or type(options).__name__)
        for layer in self.batch_statistics.layers_accepted():
            expect_buffer_writes(layers[layer])  # per-microbatch statistics were asked for: no warning
        self.hook_guard = HookGuard(layers)
        # bitsandbytes 4-bit linears whose kernel on CPU workers depends on grad mode in eval mode (packed.py)
        self.cpu_inference_4bit = cpu_inference_4bit_modules(layers) if backend != "cuda" else []
        self.split_check = None
        if self.options.split_check:
            from .adapters.hf_families import dynamic_rope_note

            self.split_check = SplitInvarianceCheck(layers, options_owner or type(options).__name__, self.root,
                                                    skip=self.batch_statistics.layers_accepted(),
                                                    hint=dynamic_rope_note)
        self.num_workers = num_workers
        self.trace = trace or TraceRecorder()
        self.trace.ask_for_timeline(bool(options.step_metrics or options.trace_steps))
        self.kept_steps: list[int] = []
        self.last_metrics: dict = {}
        self.last_tokens: int | None = None
        self._compile_mark = 0.0  # COMPILE_CLOCK's reading when the last call began
        # Called once, when the plan that will run is known: at set-up, or after the first call chose
        # its microbatch count (``planner.wants_first_batch``); the strategy prints the plan table here.
        self.plan_settled_hooks: list[Callable[[], None]] = []
        self.plan_settled = False
        self.overlapped: list = []  # OverlappedOptimizer per optimizer handed to overlap_optimizer
        self.undo_fit_warning: str | None = None  # what the last overlap_optimizer said about the undo journal not fitting the host
        self.shadows = None
        self.grad_sync = None
        pool_class = backend_class(backend)  # what the backend declares about itself
        if options.fp16_accumulation and options.compute_dtype is not torch.float16:
            computes_in = options.compute_dtype or "the weights' own dtype"
            raise OptionError(
                f"{options_owner or type(options).__name__}(fp16_accumulation=True) makes fp16 matmuls accumulate in "
                f"fp16, but this run computes in {computes_in}: use "
                "precision='16-mixed' (on accelerator='cpu', plugins=[HostScaledMixedPrecision()]), or drop the option")
        if options.recompute == "never" and not pool_class.keeps_graphs_across_workers:
            raise OptionError("recompute='never' keeps forward graphs across workers and is only supported on the CPU backend")
        t = options.transfer
        pool_opts: dict[str, Any] = dict(timeout_s=options.timeout, trace=self.trace, fifo_transfers=t.queue == "fifo",
                                         **pool_class.options_from(options))
        self.planner = PlanKeeper(layers, num_workers, options.keeper_config(pool_class, device_indices),
                                  fused_last=fused_last, progress=progress)
        engine_opts = options.engine_options(
            num_workers, self.planner.microbatches, self.planner.recompute,
            compile_layers=options.compiles_layers(pool_class.default_compile_layers(device_indices)))
        self.host_clock = HostClock(self.planner, self.trace.now)
        masters = _unique_parameters(layers)
        if options.compute_dtype is not None or options.staleness:
            from .params.shadows import ShadowStore  # uploads read compute-dtype / previous-version copies

            self.shadows = ShadowStore.for_uploads(masters, layers, options.compute_dtype, options.staleness)
        self.pool = make_pool(backend, num_workers, device_indices=device_indices, **pool_opts)
        self.fp16_accumulation = Fp16Accumulation() if options.fp16_accumulation else None
        self.gc_frozen = OlderObjectsFrozen() if options.gc_freeze else None
        try:
            self.engine = PipelineEngine(layers, self.pool, self.planner.plan, engine_opts, shadows=self.shadows,
                                         weight_gates=[self._weight_gates])
            if pool_class.pins_uploads:  # pin exactly what the uploads read, once; the pool unpins at shutdown
                read = self.shadows.upload_tensors(masters) if self.shadows is not None else masters
                self.pool.pin_uploads(options.pinned, upload_parts(read))  # packed weights: their parts
            if sync_gradients:
                from .distributed.gradient_sync import GradientSync

                self.grad_sync = GradientSync(self.engine.tables, self.trace, options.timeout)
                self.engine.grad_hooks.append(self.grad_sync.on_layer_grads)
            inside = {id(p) for p in masters}
            self.params_outside = [p for p in (root_module or module).parameters() if p.requires_grad and id(p) not in inside]
            self.engine.step_end_hooks.append(self._after_step)
            patch_forward(module, forward(self), before_copy=self.join)
        except BaseException:
            run_all([self.grad_sync.close if self.grad_sync is not None else (lambda: None), self.pool.shutdown,
                     self._release_fp16_accumulation, self._release_gc_freeze])
            raise

    def _weight_gates(self, layer_ids) -> list:
        return [c for ov in self.overlapped for c in ov.weight_gates(layer_ids)]

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer, *, staleness: int | None = None,
                          delay_per_layer_s: float | None = None, early_steps: bool = True,
                          undo: bool | None = None, loss_scaler=None):
        """Step ``optimizer`` layer by layer on a host thread, hidden behind the pipeline.

        Patches ``optimizer.step`` and ``optimizer.zero_grad`` in place and returns the
        ``OverlappedOptimizer`` driving them. ``optimizer.step()`` then
        submits every layer's update (in layer order) and returns at once; the next forward
        uploads a layer only once its update is done, so results equal the synchronous step bit
        for bit (``staleness=0``). ``staleness=1`` (set in ``RuntimeOptions``, since the
        pipeline then reads host shadows made at construction) is RoundPipe's one-step-delayed
        update. ``early_steps``: a layer may step during backward, as soon as its gradients are
        complete (only when nothing between backward and the step changes gradients). Call
        ``join`` before reading weights or optimizer state directly; ``detach`` joins and
        restores the optimizer. ``delay_per_layer_s`` (default ``options.testing.optimizer_delay_s``)
        slows every layer step (tests and benchmarks). ``undo`` (default ``options.optimizer_undo``):
        a failed step puts back every layer it stepped (from a journal of before-images bounded by
        ``options.optimizer_undo_journal_bytes``); False refuses to go on instead (see
        ``OverlappedOptimizer``), also after ``detach``, until
        ``mark_restored``. ``loss_scaler``: the enabled ``torch.amp.GradScaler`` of an fp16 run;
        each layer then unscales and checks its gradients before it steps, early steps included,
        and a step with an overflow anywhere is skipped whole (``OverlappedOptimizer``); call the
        scaler's ``update()`` after each ``step``.
        """
        from .optim.overlap import OverlappedOptimizer

        staleness = self.options.staleness if staleness is None else staleness
        if staleness != self.options.staleness:
            raise OptionError(f"overlap_optimizer(staleness={staleness}): the pipeline reads weights as "
                              f"RuntimeOptions(staleness={self.options.staleness}) set them up; pass the staleness there")
        config = self.options.overlap_config(early_steps, undo, delay_per_layer_s)
        sync = self.grad_sync.finalize_params if self.grad_sync is not None else None
        ov = OverlappedOptimizer(optimizer, config, self.engine, self.trace, before_layer_step=sync,
                                 loss_scaler=loss_scaler)
        undo = config.undo
        if undo:
            self._say_if_undo_does_not_fit(optimizer)
        self.engine.grad_hooks.append(ov.on_layer_grads)
        self.overlapped.append(ov)
        _finish_backward_before_grad_reads(optimizer, self.engine.finish_backward)
        return ov

    def _say_if_undo_does_not_fit(self, optimizer: torch.optim.Optimizer) -> None:
        """At set-up, not at the first step: warn when the undo journal and the state the first steps
        allocate exceed the host's available memory (``optim/undo_fit.py``), naming the option."""
        from .optim.undo_fit import available_host_bytes, undo_fit_message

        available = available_host_bytes()
        message = None if available is None else undo_fit_message(
            optimizer, self.options.optimizer_undo_journal_bytes, available)
        self.undo_fit_warning = message
        if message is not None:
            log.warning("RoundPipe: %s", message)

    def join(self) -> None:
        """Finish an owed backward tail (``returning_early``), then wait for every submitted layer
        optimizer step (see ``overlap_optimizer``)."""
        self.engine.finish_backward()
        for ov in self.overlapped:
            ov.join()

    def returning_early(self):
        """Around a backward that only accumulates (another pipelined call follows before anything
        reads ``.grad``): it may return before its weight gradients are in ``.grad``, so the next
        call's forward overlaps its drain (``options.overlap_calls``; a no-op when False). The next
        pipelined call, ``finish_backward``, ``join`` or an overlapped optimizer's ``step`` /
        ``zero_grad`` adds them, in the order a waiting backward would (exact). Read ``.grad``
        yourself only after one of those."""
        if not self.options.overlap_calls:
            return contextlib.nullcontext()
        return self.engine.returning_early()

    def finish_backward(self) -> None:
        """Add an owed backward tail's weight gradients to ``.grad`` now (``returning_early``); raise its failure."""
        self.engine.finish_backward()

    def run(self, inputs, loss_scale: float | None = None, tokens: int | None = None):
        """One pipelined call (what the patched forward does); keeps the step's bookkeeping."""
        self.last_tokens = tokens
        self._compile_mark = COMPILE_CLOCK.seconds()  # the step's compile seconds are not its time
        register_batch_types(inputs)
        self._choose_microbatches(inputs)
        self._settle_plan()
        self._check_batch_statistics(inputs)
        self.hook_guard.wrap_new(torch.is_grad_enabled())  # in training, a hook keeping outputs is refused
        if torch.is_grad_enabled():
            self._refuse_grad_dependent_4bit_kernels()
        self._check_split_invariance(inputs)
        called = self.trace.now()
        out = self.engine(inputs, loss_scale=loss_scale)
        run = self.engine.last_run
        if run is not None and not run.training:
            self.trace.discard_step(run.step)  # evaluation calls are not part of the training timeline
            self.host_clock.interrupted()
        elif run is not None:
            self.host_clock.forward_returned(run, called, out)
        return out

    def _refuse_grad_dependent_4bit_kernels(self) -> None:
        """Before a training call on CPU workers: no bitsandbytes 4-bit linear in eval mode, whose forward
        stages (run without grad) would take bitsandbytes' CPU inference kernel (``cpu_inference_4bit_modules``)."""
        switching = [name for name, m in self.cpu_inference_4bit if not m.training]
        if switching:
            more = f" and {len(switching) - 3} more" if len(switching) > 3 else ""
            raise OptionError(
                f"bitsandbytes 4-bit layers in eval mode ({', '.join(switching[:3])}{more}): on CPU workers with "
                f"AVX512-BF16, bitsandbytes computes an eval-mode Linear4bit called without grad with its bf16 "
                f"inference kernel, and the pipeline's forward stages run without grad, so they would not compute what "
                f"Lightning's run computes. Call model.train() before training (from_pretrained returns the model "
                f"in eval mode, and Lightning keeps submodules' modes)")

    def _choose_microbatches(self, inputs) -> None:
        """An open microbatch count is chosen again for the first batch seen (its size was unknown at set-up),
        attention priced for its sequence length, and a memory budget checked against its microbatches."""
        if not self.planner.wants_first_batch:
            return
        leaves = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim()]
        if not leaves:
            return
        first = leaves[0]
        # rows of work: every element of token ids, every vector of a floating input
        tokens = first.numel() if not first.is_floating_point() else first.numel() // max(1, first.shape[-1])
        for layer in self.engine.layers:  # a layer whose memory depends on the batch's content notes it (padding)
            observe = getattr(layer, "observe_first_batch", None)
            if callable(observe):
                observe(inputs)
        plan = self.planner.first_batch(int(first.shape[0]), max(1, tokens))
        if plan is not None:
            self.engine.set_plan(plan, self.planner.microbatches, recompute=self.planner.recompute)

    def _settle_plan(self) -> None:
        if self.plan_settled or self.planner.wants_first_batch:
            return
        self.plan_settled = True
        for hook in self.plan_settled_hooks:
            hook()

    def when_plan_settled(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once the plan that will run is known: now if it is, else in the first call,
        after its batch chose the microbatch count left open (before anything of that call runs)."""
        if self.plan_settled or not self.planner.wants_first_batch:
            self.plan_settled = True
            hook()
        else:
            self.plan_settled_hooks.append(hook)

    def _check_batch_statistics(self, inputs) -> None:
        """Refuse, before anything runs, a call whose BatchNorm would see per-microbatch statistics."""
        try:
            size = batch_size_of(inputs)
        except MicrobatchError:
            return  # the engine's split says what is wrong with the batch
        self.batch_statistics.check(min(size, self.engine.options.microbatches))

    def _check_split_invariance(self, inputs) -> None:
        """Before the first call in each training mode: every layer whole against per microbatch, on the host
        (``engine/split_invariance.py``); a layer found split-invariant with its buffer writes (LongRoPE's
        ``inv_freq``) is exact, so ``engine/buffers.py`` need not warn about it."""
        if self.split_check is None or not self.split_check.wanted():
            return
        self.join()  # the check reads the host weights
        report = self.split_check.run(inputs, self.engine.options.microbatches, timeout_s=self.options.timeout)
        if report is not None:
            for layer in report.verified:
                expect_buffer_writes(self.layers[layer])
            log.info("split-invariance check: %d rows, %.3f s on the host", report.rows, report.seconds)

    def _after_step(self, run) -> None:
        self.host_clock.backward_done(run, self.trace.records(run.step))
        if run.step % TRIM_EVERY_STEPS == 0:
            return_free_heap()  # the host threads' arenas keep freed pages otherwise (host/host_heap.py)
        new_plan = self.planner.after_step(run.measurements)
        if new_plan is not None:
            self.engine.set_plan(new_plan)
        if self.trace.enabled:
            from .tracing.timeline import step_metrics

            records = self.trace.records(run.step)
            if records:
                self.last_metrics = step_metrics(records, self.last_tokens,
                                                 compile_s=COMPILE_CLOCK.seconds() - self._compile_mark)
                self.last_metrics["peak_device_bytes"] = self.pool.peak_device_bytes()
            if len(self.kept_steps) < self.options.trace_steps:
                self.kept_steps.append(run.step)
            # late records of earlier steps (host-lane updates) too: memory stays flat (issue 43)
            self.trace.discard_unkept(run.step, self.kept_steps)

    def export_timeline(self, directory) -> list[str]:
        """Write the kept steps as a Chrome/Perfetto trace and, with matplotlib, a PNG Gantt chart."""
        from .tracing.timeline import save_gantt_png, to_chrome_trace

        records = [r for r in self.trace.records() if r.step in self.kept_steps]
        if not records:
            return []
        os.makedirs(directory, exist_ok=True)
        written = [os.path.join(directory, "roundpipe_trace.json")]
        to_chrome_trace(records, written[0])
        try:
            save_gantt_png(records, os.path.join(directory, "roundpipe_timeline.png"), title="RoundPipe timeline")
            written.append(os.path.join(directory, "roundpipe_timeline.png"))
        except ImportError as err:
            log.warning("timeline PNG not written: %s", err)
        return written

    # ------------------------------------------------------------------ constructors
    @classmethod
    def attach(cls, module: nn.Module, backend: str = "cpu", num_workers: int = 2, options: RuntimeOptions | None = None,
               kind: str | None = None, path: str | None = None, **kwargs) -> "RoundPipeRuntime":
        """Pipeline ``module`` in place: an nn.Sequential, a supported Hugging Face causal LM, a model built from a
        stack of blocks (or the block list itself), or a module declaring its chain (see adapters/target.py).

        ``kwargs`` go to the constructor: ``device_indices``, ``trace``, ``sync_gradients`` (all-reduce
        gradients over the initialised ``torch.distributed`` group), ``root_module`` (whose other
        trainable parameters are reduced whole after backward) and ``options_owner`` (how errors
        name the options, e.g. "RoundPipeStrategy") and ``progress`` (``progress(phase, done, total)``
        for the set-up: cost estimate and plan search; e.g. a
        ``RichSetupProgress``). ``path``: the module's dotted path in
        the LightningModule, for messages (a refused BERT or T5 names the ``module=`` of its block stack)."""
        options = options or RuntimeOptions()
        if kind is None:
            target = locate(module)
            module, kind = target.module, target.kind
        if kind in STACK_KINDS:
            from .adapters.stack_runtime import stack_runtime_parts

            patched, layers, forward = stack_runtime_parts(module, kind)
            return cls(patched, layers, forward, backend, num_workers, options, **kwargs)
        if kind == "sequential":
            if len(module) == 0:
                raise PlanError("the nn.Sequential to pipeline is empty")
            return cls(module, list(module), _sequential_forward, backend, num_workers, options, **kwargs)
        from .adapters.hf_causal_lm import UnsupportedModelError
        from .adapters.hf_runtime import causal_lm_runtime_parts
        from .adapters.target import stack_hint

        try:
            patched, layers, forward = causal_lm_runtime_parts(module, options)
        except UnsupportedModelError as err:
            hint = stack_hint(module, path)
            if not hint:
                raise
            raise UnsupportedModelError(f"{err} {hint}") from err
        return cls(patched, layers, forward, backend, num_workers, options, fused_last=True, **kwargs)

    def describe(self) -> str:
        """The plan's text form, the dispatch of the first step, the predicted cost table and, when the
        first batch changed the microbatch count, a line saying so."""
        note = self.planner.choice_note
        return f"{self.engine.describe()}\n{self.planner.report().to_table()}" + (f"\n{note}" if note else "")

    def peak_weight_bytes(self) -> list[int]:
        """The most weight bytes each worker held at once."""
        return self.pool.peak_weight_bytes()

    def memory_metrics(self, reset_peaks: bool = True) -> dict:
        """Memory now, as logged every step: ``host_rss_bytes`` (this process's resident memory: the
        host holds the weights, optimizer state and activations), ``pinned_bytes`` (page-locked host
        memory of the pool; 0 on the CPU backend) and ``device_peak_bytes`` (per worker, the most device
        bytes held since the last reset: the ledger of uploaded weights, plus every tensor where the
        CPU backend measures them, the allocator's peak on CUDA). ``reset_peaks``: start the peaks
        afresh, so the next call reports the next step's."""
        from .host.host_memory import host_rss_bytes

        metrics = {"host_rss_bytes": host_rss_bytes(), "pinned_bytes": self.pool.pinned_host_bytes(),
                   "device_peak_bytes": self.pool.step_peak_device_bytes()}
        if reset_peaks:
            self.pool.reset_step_peaks()
        return metrics

    def compile_metrics(self) -> dict | None:
        """With compiled layers, the process's compiled layer calls (forwards and early-stop vjps): ``graphs``
        dynamo holds for them, ``recompiles`` (graphs beyond the first of each compiled callable: one per
        layer class, device, grad mode and autocast) and ``compile_seconds`` (their first calls); else None."""
        if not self.engine.options.compile_layers:
            return None
        from .engine.compiled_layers import COMPILED_LAYERS
        from .engine.early_stop import EARLY_STOP

        return {"graphs": sum(COMPILED_LAYERS.graphs().values()) + sum(EARLY_STOP.graphs().values()),
                "recompiles": COMPILED_LAYERS.recompiles() + EARLY_STOP.recompiles(),
                "compile_seconds": COMPILED_LAYERS.compile_seconds() + sum(s for _, s in EARLY_STOP.compiles)}

    # ------------------------------------------------------------------ gradients across processes
    def begin_backward(self, accumulating: bool) -> None:
        """Before a backward: an accumulation-only one communicates nothing, a synced one starts afresh."""
        if self.grad_sync is not None:
            self.grad_sync.begin_backward(accumulating)

    def end_backward(self) -> int:
        """After a synced backward: wait for every all-reduce (and reduce what is outside the pipeline).

        Returns the bytes this backward sent (0 without gradient sync or when accumulating)."""
        sync = self.grad_sync
        if sync is None or sync.blocked:
            return 0
        sync.finish_backward(self.params_outside)
        return sync.bytes_reduced

    def weights_loaded(self) -> None:
        """The host weights were replaced (a checkpoint was loaded): the upload shadows follow them,
        and an ``optimizer_undo=False`` refusal to go on after a failed step is lifted."""
        for ov in self.overlapped:
            ov.mark_restored()
        if self.shadows is not None:
            self.shadows.refresh()

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Call after a synchronous (not overlapped) ``optimizer.step()``: it wrote the masters, and
        the uploads read the compute-dtype shadows, so these are refreshed here. ``optimizer``: the
        one that stepped (None: any; nothing to do if it is overlapped, whose layer steps refresh)."""
        overlapped = {id(ov.optimizer) for ov in self.overlapped}
        synchronous = not overlapped if optimizer is None else id(optimizer) not in overlapped
        if self.shadows is not None and synchronous:
            self.join()  # an overlapped optimizer may still write its layers' shadows
            self.shadows.refresh()

    # ------------------------------------------------------------------ teardown
    def detach(self) -> None:
        """Join and restore overlapped optimizers, restore the module's forward, stop every thread.

        Every step runs even when an earlier one raises (a failed layer step re-raises on join);
        the first error is raised at the end."""
        steps = [self.engine.finish_backward] + [ov.close for ov in self.overlapped]
        if self.grad_sync is not None:
            steps.append(self.grad_sync.close)
        steps += [lambda: unpatch(self.module), self.engine.close, self.parameter_homes.restore, self.hook_guard.unwrap,
                  self._release_fp16_accumulation,
                  self._release_gc_freeze]
        try:
            run_all(steps)
        finally:
            updated = [name for ov in self.overlapped for name in ov.unrestored]
            if updated:
                _partly_updated[self.root] = updated
            self.overlapped, self.grad_sync, self.shadows = [], None, None

    def _release_fp16_accumulation(self) -> None:
        if self.fp16_accumulation is not None:
            self.fp16_accumulation.release()

    def _release_gc_freeze(self) -> None:
        if self.gc_frozen is not None:
            self.gc_frozen.release()

    # ------------------------------------------------------------------ partly updated modules (undo=False)
    @staticmethod
    def refuse_if_partly_updated(module: nn.Module, action: str) -> None:
        """Raise if a failed step with ``optimizer_undo=False`` left ``module`` partly updated."""
        updated = _partly_updated.get(module)
        if updated:
            from .optim.overlap import StepFailed

            raise StepFailed(
                f"cannot {action}: {type(module).__name__} is partly updated: a failed optimizer step reached "
                f"{', '.join(updated)} and not the other layers, and no copy was kept to put them back "
                "(optimizer_undo=False, or past the undo journal's bound): load its weights from a checkpoint (Trainer.fit(..., ckpt_path=...)), or load them yourself "
                "and call RoundPipeRuntime.mark_restored(module)")

    @staticmethod
    def mark_restored(module: nn.Module) -> None:
        """``module``'s weights were restored (from a checkpoint) after a failed step with
        ``optimizer_undo=False``."""
        _partly_updated.pop(module, None)


class HostClock:
    """Measures the host's own work around pipelined training calls for the plan keeper
    (``observe_host``), on the trace recorder's clock:

    * between forward and backward: from the last forward output on the host (the last forward
      download in the trace; the call's return when no task was recorded) to the moment the
      output's gradient reaches the pipeline (a gradient hook on the outputs): merging the
      microbatch outputs, the caller's loss on them and its backward;
    * between steps: from the end of one training call's backward to the next training call
      (the training loop, the optimizer's submission, the next batch); an evaluation call in
      between voids that interval.
    """

    def __init__(self, planner: PlanKeeper, clock: Callable[[], float]) -> None:
        self.planner = planner
        self.clock = clock
        self.last_end: float | None = None
        self.pending: dict[int, dict] = {}  # engine step -> times of that call

    def interrupted(self) -> None:
        """An evaluation call ran: the time since the last backward is not the training loop's."""
        self.last_end = None

    def forward_returned(self, run, called: float, out) -> None:
        """Note when a pipelined call returned and how long the host spent outside the pipeline before it."""
        now = self.clock()
        entry = {"called": called, "returned": now, "outside": None if self.last_end is None else called - self.last_end}
        self.pending = {run.step: entry}  # an older call never reached backward: forget it
        if run.fused:
            return
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(lambda grad, entry=entry: self.gradient_arrived(entry))

    def gradient_arrived(self, entry: dict) -> None:
        """An output's gradient reached the pipeline (the last output's time is kept); the gradient is
        unchanged."""
        entry["gradient"] = self.clock()

    def backward_done(self, run, records) -> None:
        """Close the step's host timing when its backward is done and hand it to the planner."""
        entry = self.pending.pop(run.step, None)
        self.last_end = self.clock()
        if entry is None:
            return
        between = None
        if "gradient" in entry:
            home = [r.end for r in records if r.queue == "download" and r.stage.startswith("F")]
            between = max(0.0, entry["gradient"] - (max(home) if home else entry["returned"]))
        self.planner.observe_host(between, entry["outside"])


def check_writable_dir(directory, option: str) -> str:
    """Create ``directory`` if needed and prove it writable now, before any training starts."""
    import tempfile

    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise OptionError(f"{option}={os.fspath(directory)!r}: cannot write there ({err}); pass a writable folder") from err
    return os.fspath(directory)


def holding_cpu_generator(what: str):
    """A context holding torch's CPU generator alone: no runtime's layer that guards it runs meanwhile.
    For draws made outside pipelined calls while another runtime's layers may run (``what`` names
    the holder in timeout messages)."""
    return CPU_GENERATOR.exclusive(what)


def run_all(steps) -> None:
    """Call every step in order; if any raised, raise the first error once all have run."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the remaining steps
            if first is None:
                first = exc
            else:
                log.warning("also failed during teardown: %r", exc)
    if first is not None:
        raise first


def _finish_backward_before_grad_reads(optimizer: torch.optim.Optimizer, finish: Callable[[], None]) -> None:
    """The overlapped optimizer's ``step`` and ``zero_grad`` (patched on the instance) first finish an
    owed backward tail: ``step`` after its closure (whose forward finishes it anyway, overlapped) and
    before any layer is stepped, ``zero_grad`` before it clears. ``OverlappedOptimizer.close`` drops
    these wrappers with its own patches."""
    step, zero_grad = optimizer.step, optimizer.zero_grad

    def step_after_tail(closure=None):
        if closure is None:
            finish()
            return step()

        def closure_then_tail():
            loss = closure()
            finish()
            return loss

        return step(closure_then_tail)

    def zero_grad_after_tail(set_to_none: bool = True):
        finish()
        return zero_grad(set_to_none)

    step_after_tail._wrapped_by_lr_sched = True  # as OverlappedOptimizer marks its step (see there)
    optimizer.step = step_after_tail
    optimizer.zero_grad = zero_grad_after_tail


def _unique_parameters(layers) -> list:
    seen: dict[int, torch.Tensor] = {}
    for layer in layers:
        for p in layer.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def _sequential_forward(runtime: RoundPipeRuntime) -> Callable:
    def forward(x):
        return runtime.run(x, tokens=int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() else None)

    return forward
