"""RoundPipeStrategy: the Lightning glue. The machinery lives in ``runtime`` and ``engine``.

The LightningModule stays on the host; the strategy finds the module to pipeline, hands it to
a ``RoundPipeRuntime`` (which owns the pool, the engine, host
state, gradient sync and their teardown), and leaves Lightning's loops, precision plugin,
optimizer step, gradient clipping, accumulation and logging as they are: they act on host
parameters whose ``.grad`` the pipeline filled.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from datetime import timedelta

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from typing_extensions import override

from ..adapters.target import find_target
from ..adapters.unpipelined_calls import DirectDecoderCalls
from ..optim.per_layer_support import declaration_hint, why_not_per_layer
from ..option_docs import args_section
from ..options import OptionError, StrategyOptions, strategy_options
from ..options.keywords import RefusesUnknownKeywords, with_option_keywords
from ..runtime import RoundPipeRuntime, check_writable_dir, run_all
from ..setup_progress import RichSetupProgress
from . import weight_reads
from .checkpoint_io import AtomicCheckpointIO
from .checkpoint_policy import (checkpoint_state, load_checkpoint_state, load_overlap_state, overlap_state,
                                overlap_state_of_finished, refuse_unloadable_optimizer_states)
from .call_overlap import calls_may_overlap
from .concurrent_fits import LiveFit, gate_data_draws, ungate
from .early_steps import early_steps_allowed, layer_loss_scaler, unscales_inside_step
from .node_collectives import NodeCollectives
from .precision import HostScaledMixedPrecision, compute_dtype_of, translate
from .step_metrics import RoundPipeStepMetrics

DESCRIPTION = "RoundPipe: weights in host RAM, layer stages dispatched round-robin to stateless workers"


class RoundPipeStrategy(NodeCollectives, ParallelStrategy, RefusesUnknownKeywords):
    """Train with RoundPipe: host-resident weights, stateless workers, round-robin stage dispatch.

    ``Trainer(strategy="roundpipe", accelerator="cpu", devices=N)`` gives N virtual CPU workers;
    ``accelerator="gpu", devices=N`` gives N CUDA workers, all driven by one process.

    The keyword arguments are the fields of ``StrategyOptions``
    (documented there; Hydra group ``strategy``), or pass a ``StrategyOptions`` as ``options``.
    """

    strategy_name = "roundpipe"

    # The signature written out from StrategyOptions' fields: help(), IDEs and LightningCLI see typed keywords.
    @with_option_keywords(StrategyOptions, skip={"compute_dtype"})
    def __init__(self, options: StrategyOptions | None = None, *, accelerator: Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None, **option_values):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io or AtomicCheckpointIO(progress=lambda: self.setup_progress()),
                         precision_plugin=precision_plugin)
        if options is not None and option_values:
            raise TypeError("RoundPipeStrategy takes either options=StrategyOptions(...) or keyword options, not both")
        self.options = options if options is not None else strategy_options(**option_values)
        if isinstance(self.checkpoint_io, AtomicCheckpointIO):
            self.checkpoint_io.verify = self.options.verify_checkpoints
        self.runtime: RoundPipeRuntime | None = None
        self._live_fit: LiveFit | None = None  # while a runtime is attached (concurrent_fits.py)
        self._served_loaders: list = []  # the DataLoaders process_dataloader gated, given back at teardown
        self._direct_calls: DirectDecoderCalls | None = None  # a causal LM's decoder called around the pipeline
        self.num_nodes = 1
        self._trace_dir: str | None = None
        self._announced: str | None = None  # the plan table last printed
        self._overlap_after_fit: dict | None = None  # staleness=1: what a save after fit still needs
        # Whether accumulation-only backwards of this fit return before their tail (call_overlap.py; set in setup).
        self.calls_overlap = False

    # ------------------------------------------------------------------ devices and nodes
    @property
    @override
    def root_device(self) -> torch.device:
        return torch.device("cpu")  # the host is the home of all model state

    def _backend(self) -> tuple[str, list[int] | None]:
        types = {d.type for d in self.parallel_devices or [torch.device("cpu")]}
        if types == {"cpu"}:
            return "cpu", None
        if types == {"cuda"}:
            return "cuda", [d.index or 0 for d in self.parallel_devices]
        raise ValueError(f"RoundPipeStrategy runs on accelerator='cpu' (virtual workers) or accelerator='gpu' "
                         f"(CUDA workers); got devices of type {sorted(types)}")

    @property
    def num_workers(self) -> int:
        """Number of workers: the Trainer's devices."""
        return len(self.parallel_devices or [None])

    @property
    def is_distributed(self) -> bool:
        """Whether more than one node trains."""
        return self.world_size > 1

    def set_world_ranks(self) -> None:  # one process per node
        """One process per node: the node rank is the global rank."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank)
            self.cluster_environment.set_world_size(self.num_nodes)
        rank_zero_only.rank = self.global_rank

    @override
    def _configure_launcher(self) -> None:
        env = self.cluster_environment
        if self.num_nodes > 1 and env is not None and not env.creates_processes_externally:
            # Lightning's own launcher, with one process per node: it sets the environment and starts no child.
            self._launcher = _SubprocessScriptLauncher(env, num_processes=1, num_nodes=self.num_nodes)

    @override
    def setup_environment(self) -> None:
        timeout = self.options.timeout
        if self.world_size > 1:
            try:
                _init_dist_connection(self.cluster_environment, "gloo", timeout=timedelta(seconds=timeout))
            except Exception as err:
                env = self.cluster_environment
                raise RuntimeError(f"rank {self.global_rank} of {self.world_size} could not join the other nodes at "
                                   f"{env.main_address}:{env.main_port} within {timeout:g}s: {err}") from err
        backend, indices = self._backend()
        workers = self.options.workers
        if workers is not None and workers != self.num_workers:
            raise ValueError(f"RoundPipeStrategy(workers={workers}) does not match Trainer(devices={self.num_workers}): "
                             "set them to the same number (or leave workers unset)")
        if self.num_workers == 1:
            rank_zero_warn("RoundPipe has one worker, which cannot pipeline: stages run one after another. Ask for "
                           "more with Trainer(strategy='roundpipe', devices=N) (N CPU workers or N GPUs).")
        if backend == "cuda":
            self.accelerator.setup_device(torch.device("cuda", indices[0]))

    # ------------------------------------------------------------------ model
    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def setup(self, trainer) -> None:
        backend, indices = self._backend()
        self.precision_plugin = translate(self.precision_plugin, backend)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.options.trace_steps and fitting:
            self._trace_dir = check_writable_dir(self.options.trace_dir or trainer.default_root_dir,
                                                        "RoundPipeStrategy(trace_dir)")
        super().setup(trainer)  # precision conversion, model to host, optimizers
        target = find_target(self.lightning_module, self.options.module)
        # The precision plugin decides the upload dtype: a new options value, the validated one left as it was.
        self.options = dataclasses.replace(self.options, compute_dtype=compute_dtype_of(self.precision_plugin))
        if self.world_size > 1:
            from ..distributed.gradient_sync import broadcast_module

            broadcast_module(self.lightning_module)  # every node starts from rank 0's weights
        self._live_fit = LiveFit()
        self.runtime = RoundPipeRuntime.attach(
            target.module, backend=backend, num_workers=self.num_workers, options=self.options.runtime_options(),
            kind=target.kind, path=target.path, device_indices=indices, sync_gradients=self.world_size > 1,
            root_module=self.lightning_module, options_owner="RoundPipeStrategy", progress=self.setup_progress())
        self._direct_calls = _watch_decoder(target)
        plugin = self.precision_plugin
        if isinstance(plugin, HostScaledMixedPrecision):
            plugin.steps_early(None)  # a previous fit's optimizers
        if fitting and self.optimizers and self.options.overlaps_optimizer(backend, self.num_workers):
            undo = self.options.optimizer_undo
            early = early_steps_allowed(trainer, self.lightning_module, plugin, undo)
            # fp16: with early steps, each layer unscales and checks its gradients before it steps (precision.py)
            scaler = layer_loss_scaler(plugin, undo) if early and not self.options.staleness else None
            for opt in self.optimizers:
                if self._steps_layer_by_layer(opt):
                    ov = self.runtime.overlap_optimizer(opt, early_steps=early, loss_scaler=scaler)
                    if scaler is not None:
                        plugin.steps_early(ov)
            weight_reads.join_before_reads(self.lightning_module, self.join)
        self.calls_overlap = bool(fitting and self.options.overlap_calls
                                   and calls_may_overlap(trainer, self.lightning_module))
        if (self.options.step_metrics and self.options.log_step_metrics
                and not any(isinstance(cb, RoundPipeStepMetrics) for cb in trainer.callbacks)):
            trainer.callbacks.append(RoundPipeStepMetrics(prog_bar=self.options.progress_bar_metrics))
        # The plan table once the plan that will run is known (after the first batch chose an open microbatch count).
        self.runtime.when_plan_settled(lambda runtime=self.runtime: self._announce_plan(target, runtime))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A DataLoader's draws from torch's CPU generator wait for other fits' layers (``concurrent_fits``)."""
        gated = gate_data_draws(dataloader)
        self._served_loaders.append(gated)
        return gated

    def _steps_layer_by_layer(self, optimizer) -> bool:
        """Whether ``optimizer`` may be stepped layer by layer behind the pipeline; if not, Lightning
        steps it whole after backward (exact, not overlapped), and staleness=1, which needs the
        overlap, is refused."""
        reason = why_not_per_layer(optimizer)
        if reason is None and getattr(self.precision_plugin, "scaler", None) is not None and unscales_inside_step(optimizer):
            reason = ("it unscales the loss-scaled gradients inside its own step (a fused optimizer), from the scale "
                      "GradScaler.step hands the whole optimizer")
        if reason is None:
            return True
        name = type(optimizer).__name__
        if self.options.staleness:
            raise OptionError(f"RoundPipeStrategy(staleness=1) steps the optimizer layer by layer, which is not exact "
                              f"for {name}: {reason}. Use staleness=0, or, {declaration_hint(optimizer)}")
        rank_zero_info(f"RoundPipe steps {name} whole after backward, not layer by layer behind the pipeline: "
                       f"{reason}. For the overlap, {declaration_hint(optimizer)}")
        return False

    def setup_progress(self) -> RichSetupProgress | None:
        """Progress bars for long set-up work, on rank zero only (the other nodes do the same work)."""
        return RichSetupProgress() if self.is_global_zero else None

    def _announce_plan(self, target, runtime: RoundPipeRuntime) -> None:
        """Print the plan table on rank zero once, and again only for another module or plan: the
        runtime is rebuilt for every Trainer call (validate, fit, validate) but mostly to the same plan."""
        announced = f"RoundPipe pipelines `{target.path}` ({type(target.module).__name__})\n{runtime.describe()}"
        if announced != self._announced:
            self._announced = announced
            rank_zero_info(announced)

    def join(self) -> None:
        """Wait for every submitted layer optimizer step (call before reading weights directly)."""
        if self.runtime is not None:
            self.runtime.join()

    # Every place Lightning reads weights or optimizer state joins first (Strategy hooks of the same signature).
    on_validation_start = on_test_start = on_predict_start = on_train_end = join

    @override
    def lightning_module_state_dict(self) -> dict:
        self.join()
        RoundPipeRuntime.refuse_if_partly_updated(self.lightning_module, "save a checkpoint")
        return checkpoint_state(self.lightning_module, self.options.checkpoint_weights)

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        self.join()
        # Lightning loads the optimizer state later: a mismatch must fail before the weights load
        module = self.lightning_module
        check = (lambda: refuse_unloadable_optimizer_states(module, checkpoint)) if self._fitting() else None
        load_checkpoint_state(module, checkpoint["state_dict"], strict, before_load=check)
        RoundPipeRuntime.mark_restored(self.lightning_module)  # optimizer_undo=False: no longer partly updated
        self._overlap_after_fit = None  # the previous weights of the last fit belong to other weights now
        if self.runtime is not None:
            self.runtime.weights_loaded()

    def _fitting(self) -> bool:
        try:
            trainer = self.lightning_module.trainer
        except RuntimeError:  # not attached to a Trainer
            return False
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    @override
    def optimizer_state(self, optimizer) -> dict:
        self.join()
        return super().optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Lightning calls this when resuming a fit, after the weights and before the first step."""
        self.join()
        super().load_optimizer_state_dict(checkpoint)
        if self.runtime is not None and self.runtime.overlapped:
            load_overlap_state(self.runtime.overlapped, checkpoint)

    @override
    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        self.join()
        fitting = self.runtime is not None and self.runtime.overlapped
        extra = overlap_state(self.runtime.overlapped) if fitting else self._overlap_after_fit
        if extra is not None and "optimizer_states" in checkpoint:  # a weights-only save resumes nothing
            checkpoint["roundpipe"] = extra
        if self.is_global_zero:  # every node holds the same weights
            super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def backward(self, closure_loss, optimizer, *args, **kwargs):
        # Lightning runs this after training_step returned: no pipelined call of the step follows.
        with ExitStack() as stack:
            for ov in self.runtime.overlapped if self.runtime is not None else ():
                stack.enter_context(ov.last_backward())
            if self._accumulating and self.calls_overlap and self.runtime is not None:
                # Accumulation only: the next batch's forward finishes this backward's tail (call_overlap.py).
                stack.enter_context(self.runtime.returning_early())
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def pre_backward(self, closure_loss) -> None:
        """Tell the runtime a backward starts (and whether this step only accumulates: no all-reduce)."""
        if self.runtime is not None:
            self.runtime.begin_backward(self._accumulating)

    @override
    def post_backward(self, closure_loss) -> None:
        """Tell the runtime the backward ended; keeps the gradient bytes it reduced across nodes."""
        if self.runtime is not None:
            self.last_bytes_reduced = self.runtime.end_backward()

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        runtime = self.runtime

        def closure_then_tail():
            # The step's own batch finished an owed tail when it entered the engine; a training_step
            # that never called the pipelined module did not: clipping, hooks and the step read .grad next.
            result = closure()
            if runtime is not None:
                runtime.finish_backward()
            return result

        out = super().optimizer_step(optimizer, closure_then_tail, model, **kwargs)
        if self.runtime is not None:
            if not self.options.staleness:
                # Every read after the step returns sees the new weights (an EMA or a logger over the
                # inner model, peft's AdaLoRA in on_train_batch_end), and a failed layer step fails
                # this step before Lightning counts it (global_step, schedulers). The layers stepped
                # during backward are done by now; what is left is the tail after the closure.
                self.runtime.join()
            self.runtime.after_optimizer_step(optimizer)
        return out

    @override
    def teardown(self) -> None:
        """Every step runs even when one raises (a failed step's error re-raises on join); the first error wins."""
        runtime, module = self.runtime, self.lightning_module
        steps = []
        if module is not None:
            steps.append(lambda: weight_reads.restore(module))
        if isinstance(self.precision_plugin, HostScaledMixedPrecision):
            steps.append(lambda: self.precision_plugin.steps_early(None))  # the overlapped optimizers go with the runtime
        if runtime is not None:
            steps.append(lambda: self._keep_overlap_state(runtime))
            if self.options.trace_steps and self._trace_dir:
                steps.append(lambda: self._export_timeline(runtime))
            steps.append(runtime.detach)
        if self._live_fit is not None:
            steps.append(self._live_fit.leave)
        loaders, self._served_loaders = self._served_loaders, []
        steps.extend(lambda loader=loader: ungate(loader) for loader in loaders)
        if self._direct_calls is not None:
            steps.append(self._direct_calls.remove)
            self._direct_calls = None
        steps.append(super().teardown)
        self.runtime, self._live_fit = None, None
        run_all(steps)

    def _keep_overlap_state(self, runtime: RoundPipeRuntime) -> None:
        # ``trainer.save_checkpoint`` after fit still saves the optimizer; the delayed update's
        # previous weights must travel with it, but the runtime is gone by then.
        if runtime.overlapped:  # a fit: validate / test / predict change no weights
            self._overlap_after_fit = overlap_state_of_finished(runtime.overlapped)

    def _export_timeline(self, runtime: RoundPipeRuntime) -> None:
        # The steps trained already: an artefact that cannot be written must not fail the fit (issue 43).
        try:
            written = runtime.export_timeline(self._trace_dir)
        except OSError as err:
            rank_zero_warn(f"RoundPipe could not write its timeline to RoundPipeStrategy(trace_dir={self._trace_dir!r}): "
                           f"{err}. Training finished; choose a writable trace_dir (or trace_steps=0) next time.")
            return
        if written:
            rank_zero_info(f"RoundPipe timeline written: {', '.join(written)}")

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=DESCRIPTION)


def _describe_options(init) -> None:
    """The keyword options described on the generated ``__init__``, for help(), IDEs and LightningCLI
    (jsonargparse reads the Args section)."""
    init.__doc__ = "\n".join((
        "Validate the options (see ``docs/options.md``).", "",
        args_section(StrategyOptions, skip={"compute_dtype"}),
        "    options: all the options at once, instead of the keywords.",
        *(f"    {name}: set by the Trainer." for name in
          ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")),
    ))


_describe_options(RoundPipeStrategy.__init__)


def _watch_decoder(target) -> DirectDecoderCalls | None:
    """For a pipelined causal LM: warn once if its decoder is called directly (``adapters/unpipelined_calls``)."""
    if target.kind != "causal_lm":
        return None
    from ..adapters.hf_causal_lm import unwrap_peft

    get_decoder = getattr(unwrap_peft(target.module), "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if not isinstance(decoder, torch.nn.Module) or decoder is target.module:
        return None
    return DirectDecoderCalls(target.module, decoder)


def register() -> None:
    """Register ``strategy="roundpipe"`` with Lightning (once)."""
    if RoundPipeStrategy.strategy_name not in StrategyRegistry:
        RoundPipeStrategy.register_strategies(StrategyRegistry)
