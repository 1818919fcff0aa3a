"""Fine-tune a Hugging Face causal LM with Lightning, pipelined by RoundPipe (Hydra job).

    python examples/finetune.py                        # tiny Qwen3 on Shakespeare, 2 CPU workers
    python examples/finetune.py model=tiny_llama strategy.microbatches=4 trainer.max_steps=20 lora=on
    python examples/finetune.py strategy=default       # Lightning's single-device strategy, to compare
    python examples/finetune.py experiment=qwen3_8b_lora_8gpu model.path=/models/Qwen3-8B
    python examples/finetune.py --multirun experiment=tiny strategy.microbatches=2,4
    python examples/finetune.py --cfg job experiment=tiny    # print the composed config, run nothing
    python examples/finetune.py logger=tensorboard callbacks=[model_checkpoint,lr_monitor]
    python examples/finetune.py ckpt_path=outputs/<date>/<time>/last.ckpt trainer.max_steps=80   # resume

Configs live in ``conf/``, presets in ``conf/experiment/`` (see docs/finetune.md); everything the
job writes goes to Hydra's run directory (``outputs/<date>/<time>/``). The job prints the resolved config, measures
validation perplexity before training, fine-tunes, measures it again, prints training loss,
tokens/s and wall time (all through ``logging``, so Hydra's ``finetune.log`` holds them), and writes a checkpoint (and the LoRA adapter when ``lora=on``) to
``out_dir`` (by default that run directory). The LightningModule and DataModule are the plain ones of
``lightning_roundpipe.finetune``: only the Trainer's strategy changes.
"""

from __future__ import annotations

import inspect
import math
import sys
import time
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

try:
    import lightning_roundpipe  # noqa: F401
except ModuleNotFoundError as missing:  # a checkout without `pip install -e .`: use its src/
    if missing.name != "lightning_roundpipe":
        raise
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import lightning.pytorch as pl
import torch

from lightning_roundpipe.finetune import CausalLMFineTune, FineTuneInputError, TextDataModule, TokenThroughput
from lightning_roundpipe.finetune.config import check_job_values, check_no_missing, register_resolvers
from lightning_roundpipe.finetune.job_config import (build_callbacks, build_logger, check_keys_are_read,
                                                     checked_ckpt_path, trainer_arguments)
from lightning_roundpipe.finetune.job_output import exit_on_input_error, report, route_lightning_logging

register_resolvers()

# Deprecation warnings raised inside third-party code on every run, which a user of this job
# can do nothing about (each library calls an API another one deprecated); shown once here.
THIRD_PARTY_DEPRECATIONS = [
    # lightning 2.6's pytree helper calls torch 2.13's deprecated LeafSpec check.
    (r".*isinstance\(treespec, LeafSpec\)", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    # peft 0.21 reads transformers 5's deprecated alias `is_gradient_checkpointing` (lora=on).
    (r".*`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils"),
]


def hide_third_party_deprecations() -> None:
    """Silence exactly the warnings in ``THIRD_PARTY_DEPRECATIONS``; every other warning still shows."""
    for message, category, module in THIRD_PARTY_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def strategy_options(cfg: DictConfig, accepted: set[str]) -> dict:
    """Keyword arguments for the strategy class: ``cfg.strategy`` plus partition, transfer and trace."""
    options = OmegaConf.to_container(cfg.strategy, resolve=True)
    options.pop("_target_")
    options["partition"] = OmegaConf.to_container(cfg.partition, resolve=True)
    options["transfer"] = OmegaConf.to_container(cfg.transfer, resolve=True)
    options["trace_steps"] = cfg.trace_steps if cfg.trace else 0
    options["trace_dir"] = str(cfg.out_dir)
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise FineTuneInputError(f"strategy options {unknown} are not options of {cfg.strategy._target_}")
    return options


def build_strategy(cfg: DictConfig) -> tuple[object, int | str]:
    """The Trainer's ``strategy`` argument and device count, from ``cfg.strategy``.

    A config with ``_target_`` (RoundPipe) is instantiated with the partition and transfer
    groups as plain dicts (and the trace settings); otherwise ``name`` is a Lightning strategy
    name used as is, on ``cfg.strategy.devices`` devices.
    """
    if cfg.strategy.get("_target_"):
        target = hydra.utils.get_class(cfg.strategy._target_)
        accepted = set(inspect.signature(target).parameters)
        return target(**strategy_options(cfg, accepted)), cfg.trainer.devices
    if cfg.trace:
        report(f"note: trace=true needs strategy=roundpipe; strategy {cfg.strategy.name!r} records no trace")
    return cfg.strategy.name, cfg.strategy.get("devices", cfg.trainer.devices)


def epochs_for(max_steps: int, accumulate_grad_batches: int, batches_per_epoch: int) -> int | None:
    """Epochs that ``max_steps`` optimizer steps span (``None`` when ``max_steps`` is unbounded).

    Given as the Trainer's ``max_epochs`` so the progress bar reads ``Epoch 0/0`` rather than
    Lightning's ``Epoch 0/-2`` for "no epoch limit"; ``max_steps`` is still reached first, so the
    run and its learning-rate schedule are unchanged.
    """
    if max_steps < 0:
        return None
    return max(1, math.ceil(max_steps * accumulate_grad_batches / max(1, batches_per_epoch)))


def checkpoint_epoch(ckpt_path: str | None) -> int:
    """The epoch a checkpoint was saved in (0 without one); memory-mapped, so its weights are not read."""
    if ckpt_path is None:
        return 0
    return int(torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False).get("epoch", 0))


def build_trainer(cfg: DictConfig, callbacks: list[pl.Callback], batches_per_epoch: int,
                  resumed_epoch: int = 0) -> pl.Trainer:
    """A Trainer from ``cfg.trainer`` (every key passed through), the chosen strategy, ``cfg.logger``
    and ``cfg.callbacks`` after the job's own ``callbacks``. ``resumed_epoch``: the epoch of the
    checkpoint resumed from, which the epoch limit counts on from (a run's final checkpoint is
    saved as its epoch ended)."""
    strategy, devices = build_strategy(cfg)
    t = cfg.trainer
    callbacks = [*callbacks, *build_callbacks(cfg.get("callbacks"))]
    epochs = epochs_for(t.max_steps, t.accumulate_grad_batches, batches_per_epoch)
    job_set = {
        "max_epochs": None if epochs is None else resumed_epoch + epochs,
        "num_sanity_val_steps": 0,  # the job validates in full before training anyway
        # The job writes one checkpoint at the end; a ModelCheckpoint callback (callbacks=) adds its own.
        "enable_checkpointing": any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
    }
    arguments = trainer_arguments(t, job_set)
    arguments.update(devices=devices, strategy=strategy, logger=build_logger(cfg.get("logger")), callbacks=callbacks)
    return pl.Trainer(**arguments)


def run(cfg: DictConfig) -> dict:
    """Run the job; returns the numbers it prints (and the paths it wrote)."""
    route_lightning_logging()
    check_no_missing(cfg)
    check_keys_are_read(cfg, TextDataModule)
    check_job_values(cfg)  # before loading anything: a bad value fails now, naming its key
    ckpt_path = checked_ckpt_path(cfg.get("ckpt_path"))
    hide_third_party_deprecations()
    pl.seed_everything(cfg.seed, workers=True)
    out_dir = Path(cfg.out_dir)
    report(OmegaConf.to_yaml(cfg, resolve=True))

    data = TextDataModule(
        model_path=cfg.model.path,
        tokenizer=cfg.model.tokenizer,
        seed=cfg.seed,
        **OmegaConf.to_container(cfg.data, resolve=True),  # every key of conf/data/ is an option
    )
    data.setup("fit")  # tokenize now: a text too short for one batch fails before any training
    module = CausalLMFineTune(
        model_path=cfg.model.path,
        lora=OmegaConf.to_container(cfg.lora, resolve=True),
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        dtype=cfg.model.dtype,
    )
    throughput = TokenThroughput()
    trainer = build_trainer(cfg, [throughput], batches_per_epoch=len(data.train_dataloader()),
                            resumed_epoch=checkpoint_epoch(ckpt_path))

    started = time.perf_counter()
    # Resuming: "before" is the checkpoint's model (validate loads its weights), then fit restores the whole state.
    before = trainer.validate(module, datamodule=data, ckpt_path=ckpt_path, verbose=False)[0]
    fit_started = time.perf_counter()
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    fit_seconds = time.perf_counter() - fit_started
    train_loss = float(trainer.callback_metrics["train_loss"])
    after = trainer.validate(module, datamodule=data, verbose=False)[0]
    wall_seconds = time.perf_counter() - started

    checkpoint = out_dir / "last.ckpt"
    trainer.save_checkpoint(checkpoint, weights_only=False)  # full state: resumable
    adapter = module.save_adapter(out_dir / "adapter") if trainer.is_global_zero else None

    results = {
        "train_loss": train_loss,
        "val_ppl_before": float(before["val_ppl"]),
        "val_ppl_after": float(after["val_ppl"]),
        "tokens_per_s": throughput.tokens_per_s,
        "fit_seconds": fit_seconds,
        "wall_seconds": wall_seconds,
        "steps": trainer.global_step,
        "checkpoint": checkpoint,
        "adapter": adapter,
    }
    if trainer.is_global_zero:
        report(
            f"\nsteps:                {results['steps']}\n"
            f"training loss (last): {train_loss:.4f}\n"
            f"validation perplexity: {results['val_ppl_before']:.3f} before -> {results['val_ppl_after']:.3f} after\n"
            f"throughput:           {results['tokens_per_s']:,.0f} tokens/s\n"
            f"wall time:            {fit_seconds:.1f} s training, {wall_seconds:.1f} s with validation\n"
            f"checkpoint:           {checkpoint}"
            + (f"\nLoRA adapter:         {adapter}" if adapter else "")
        )
    return results


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    """Hydra entry point; ``main(cfg)`` with a composed config also works (tests do that).

    From the command line a user-input error (``FineTuneInputError``, ``OptionError``) prints its
    message, without a traceback, and exits 1 (``HYDRA_FULL_ERROR=1``: the traceback); called with
    a composed config outside a Hydra run, it raises.
    """
    if not HydraConfig.initialized():
        return run(cfg)
    return exit_on_input_error(lambda: run(cfg))


if __name__ == "__main__":
    main()
