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
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from .options import OptionError, RuntimeOptions
from .workers.matmul_accumulation import Fp16Accumulation
from .host.host_gc import OlderObjectsFrozen
from .host.host_heap import TRIM_EVERY_STEPS, return_free_heap
from .engine import PipelineEngine
from .engine.rng import CPU_GENERATOR
from .engine.microbatch import register_batch_types
from .engine.layer_call import HookGuard, expect_buffer_writes
from .engine.split_invariance import SplitInvarianceCheck
from .params.packed import cpu_inference_4bit_modules, upload_parts
from .params.weights import unique_parameters
from .schedule.plan import PlanError
from .planning.keeper import PlanKeeper
from .adapters.batch_statistics import BatchStatistics
from .adapters.target import STACK_KINDS, ParameterHomes, locate, patch_forward, unpatch
from .setup_progress import ProgressCallback
from .tracing.records import HostClock, TraceRecorder
from .workers import backend_class, make_pool
from .host.compile_clock import COMPILE_CLOCK
from .optim.overlap import OverlappedOptimizer
from .optim.partly_updated import mark_restored, record_partly_updated, refuse_if_partly_updated
from .optim.user_optimizer import StepRouting
from .optim.undo_fit import say_if_undo_does_not_fit
from .teardown import run_all
from .tracing.export import check_writable_dir, export_timeline

log = logging.getLogger("lightning_roundpipe")

__all__ = ["RoundPipeRuntime", "RuntimeOptions", "check_writable_dir", "run_all"]


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
        self._on_plan_settled: Callable[[], None] | None = None  # ``when_plan_settled``'s hook (the plan table)
        self.plan_settled = False
        self.overlapped: list = []  # OverlappedOptimizer per optimizer handed to overlap_optimizer
        self.routings: list = []  # StepRouting per optimizer handed to overlap_optimizer (its step and zero_grad)
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
        self.host_clock = HostClock(self.planner.unread_host, self.trace.now)
        masters = unique_parameters(layers)
        if options.compute_dtype is not None or options.staleness:
            from .params.shadows import ShadowStore  # uploads read compute-dtype / previous-version copies

            self.shadows = ShadowStore.for_uploads(masters, layers, options.compute_dtype, options.staleness)
        self.pool = make_pool(backend, num_workers, device_indices=device_indices, **pool_opts)
        self.fp16_accumulation = Fp16Accumulation() if options.fp16_accumulation else None
        self.gc_frozen = OlderObjectsFrozen() if options.gc_freeze else None
        try:
            self.engine = PipelineEngine(layers, self.pool, self.planner.plan, engine_opts, shadows=self.shadows)
            if pool_class.pins_uploads:  # pin exactly what the uploads read, once; the pool unpins at shutdown
                read = self.shadows.upload_tensors(masters) if self.shadows is not None else masters
                self.pool.pin_uploads(options.pinned, upload_parts(read))  # packed weights: their parts
            if sync_gradients:
                from .distributed.gradient_sync import GradientSync

                self.grad_sync = GradientSync(self.engine.tables, self.trace, options.timeout)
            inside = {id(p) for p in masters}
            self.params_outside = [p for p in (root_module or module).parameters() if p.requires_grad and id(p) not in inside]
            self.engine.listen(self)  # the way back: on_grads_ready, upload_waits_for, on_backward_done below
            patch_forward(module, forward(self), before_copy=self.join)
        except BaseException:
            run_all([self.grad_sync.close if self.grad_sync is not None else (lambda: None), self.pool.shutdown,
                     self._release_fp16_accumulation, self._release_gc_freeze])
            raise

    # ------------------------------------------------------------------ the way back (engine.EngineListener)
    def upload_waits_for(self, layer_ids: range) -> list:
        """An upload of these layers waits for their pending optimizer steps (every overlapped optimizer's)."""
        return [c for ov in self.overlapped for c in ov.upload_waits_for(layer_ids)]

    def on_grads_ready(self, layer_ids: range) -> None:
        """These layers' ``.grad`` holds the call's gradients: start their all-reduce, then their early steps."""
        if self.grad_sync is not None:
            self.grad_sync.on_grads_ready(layer_ids)
        for ov in self.overlapped:
            ov.on_grads_ready(layer_ids)

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer, *, staleness: int | None = None,
                          delay_per_layer_s: float | None = None, early_steps: bool = True,
                          undo: bool | None = None, loss_scaler=None):
        """Step ``optimizer`` layer by layer on a host thread, hidden behind the pipeline; returns the
        ``OverlappedOptimizer``, to which ``optimizer.step`` / ``zero_grad`` are routed (``StepRouting``).

        ``optimizer.step()`` submits every layer's update (in layer order) and returns at once; the
        next forward uploads a layer only once its update is done, so results equal the synchronous
        step bit for bit (``staleness=0``; ``staleness=1``, set in ``RuntimeOptions``, is RoundPipe's
        one-step-delayed update). ``early_steps``: a layer may step during backward once its gradients
        are complete (only when nothing between backward and the step changes gradients). Call ``join``
        before reading weights or optimizer state directly; ``detach`` joins and restores the optimizer.
        ``delay_per_layer_s`` (default ``options.testing.optimizer_delay_s``) slows every layer step.
        ``undo`` (default ``options.optimizer_undo``): a failed step puts back every layer it stepped
        (a journal bounded by ``options.optimizer_undo_journal_bytes``); False refuses to go on instead,
        also after ``detach``, until ``mark_restored``. ``loss_scaler``: an fp16 run's enabled
        ``GradScaler``; each layer unscales and checks its gradients before it steps, and a step with an
        overflow anywhere is skipped whole; call the scaler's ``update()`` after each ``step``."""
        staleness = self.options.staleness if staleness is None else staleness
        if staleness != self.options.staleness:
            raise OptionError(f"overlap_optimizer(staleness={staleness}): the pipeline reads weights as "
                              f"RuntimeOptions(staleness={self.options.staleness}) set them up; pass the staleness there")
        config = self.options.overlap_config(early_steps, undo, delay_per_layer_s)
        sync = self.grad_sync.finalize_params if self.grad_sync is not None else None
        ov = OverlappedOptimizer(optimizer, config, self.engine, self.trace, before_layer_step=sync,
                                 loss_scaler=loss_scaler)
        if config.undo:  # at set-up, not at the first step (optim/undo_fit.py)
            self.undo_fit_warning = say_if_undo_does_not_fit(optimizer, config.journal_bytes)
        routing = StepRouting(optimizer, ov, self.engine.finish_backward)
        routing.install()  # optimizer.step / zero_grad now reach ov (the one wrapper of the user's optimizer)
        self.overlapped.append(ov)
        self.routings.append(routing)
        return ov

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
        if self.batch_statistics.found:  # a batch-dependent layer among the pipelined ones (found at set-up)
            self.batch_statistics.check_call(inputs, self.engine.options.microbatches)
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
        if self.plan_settled or not self.planner.wants_first_batch:
            return  # settled: the first batch's choices are made (they are never wanted again)
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
        hook, self._on_plan_settled = self._on_plan_settled, None
        if hook is not None:
            hook()

    def when_plan_settled(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once the plan that will run is known: now if it is, else in the first call,
        after its batch chose the microbatch count left open (before anything of that call runs). One
        hook at a time: the strategy's plan announcement."""
        if self.plan_settled or not self.planner.wants_first_batch:
            self.plan_settled = True
            hook()
        elif self._on_plan_settled is not None:
            raise RuntimeError("when_plan_settled: a hook is already waiting for the plan to settle")
        else:
            self._on_plan_settled = hook

    def _check_split_invariance(self, inputs) -> None:
        """Before the first call in each training mode: every layer whole against per microbatch, on the host
        (``engine/split_invariance.py``); a layer found split-invariant with its buffer writes (LongRoPE's
        ``inv_freq``) is exact, so ``engine/layer_call.py`` need not warn about it."""
        if self.split_check is None or tuple(layer.training for layer in self.layers) in self.split_check.checked:
            return  # this training mode was checked already
        self.join()  # the check reads the host weights
        report = self.split_check.run(inputs, self.engine.options.microbatches, timeout_s=self.options.timeout)
        if report is not None:
            for layer in report.verified:
                expect_buffer_writes(self.layers[layer])
            log.info("split-invariance check: %d rows, %.3f s on the host", report.rows, report.seconds)

    def on_backward_done(self, run) -> None:
        """A training call's backward is done: host timing and a re-plan for the keeper, the step's metrics."""
        self.host_clock.backward_done(run, self.trace.records(run.step))
        if run.step % TRIM_EVERY_STEPS == 0:
            return_free_heap()  # the host threads' arenas keep freed pages otherwise (host/host_heap.py)
        planner = self.planner
        planner.unread.append(run.measurements)  # read by the planner at its next check (``PlanKeeper.read``)
        if planner.steps_seen + len(planner.unread) >= planner.next_read:
            new_plan = planner.after_steps()
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
        return export_timeline([r for r in self.trace.records() if r.step in self.kept_steps], directory)

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
        steps = [self.engine.finish_backward] + [routing.close for routing in self.routings]
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
                record_partly_updated(self.root, updated)
            self.overlapped, self.routings, self.grad_sync, self.shadows = [], [], None, None

    def _release_fp16_accumulation(self) -> None:
        if self.fp16_accumulation is not None:
            self.fp16_accumulation.release()

    def _release_gc_freeze(self) -> None:
        if self.gc_frozen is not None:
            self.gc_frozen.release()

    refuse_if_partly_updated = staticmethod(refuse_if_partly_updated)  # undo=False: optim/partly_updated.py
    mark_restored = staticmethod(mark_restored)


def holding_cpu_generator(what: str):
    """A context holding torch's CPU generator alone: no runtime's layer that guards it runs meanwhile.
    For draws made outside pipelined calls while another runtime's layers may run (``what`` names
    the holder in timeout messages)."""
    return CPU_GENERATOR.exclusive(what)


def _sequential_forward(runtime: RoundPipeRuntime) -> Callable:
    def forward(x):
        return runtime.run(x, tokens=int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() else None)

    return forward
