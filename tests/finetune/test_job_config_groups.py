"""Issue 24 items 11-13: logger, callbacks and resume from the config; keys the job would ignore are
refused naming the key; user-input errors print one message (no traceback unless HYDRA_FULL_ERROR=1);
Hydra's finetune.log holds the plan table and the summary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_roundpipe.finetune import FineTuneInputError
from test_finetune_job import compose_job, load_example

REPO = Path(__file__).resolve().parents[2]


def job(cwd: Path, *args: str, full_error: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)}
    env.pop("HYDRA_FULL_ERROR", None)
    if full_error:
        env["HYDRA_FULL_ERROR"] = "1"
    return subprocess.run([sys.executable, str(REPO / "examples" / "finetune.py"), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


# ----------------------------------------------------------------------------- item 11: groups


def built_trainer(tmp_path, *overrides: str) -> pl.Trainer:
    cfg = compose_job(f"out_dir={tmp_path}", *overrides)
    return load_example().build_trainer(cfg, [], batches_per_epoch=52)


def test_trainer_keys_pass_through_to_the_trainer(tmp_path):
    # before: +trainer.max_epochs=7 was accepted and the Trainer ran with max_epochs=1 (from max_steps)
    assert built_trainer(tmp_path).max_epochs == 1
    assert built_trainer(tmp_path, "+trainer.max_epochs=7").max_epochs == 7
    assert built_trainer(tmp_path, "+trainer.num_sanity_val_steps=2").num_sanity_val_steps == 2


@pytest.mark.parametrize("override, logger_class, directory", [
    ((), CSVLogger, "logs"), (("logger=csv",), CSVLogger, "logs"), (("logger=tensorboard",), TensorBoardLogger, "tensorboard"),
])
def test_logger_group_picks_the_lightning_logger(tmp_path, override, logger_class, directory):
    trainer = built_trainer(tmp_path, *override)
    assert type(trainer.logger) is logger_class
    assert Path(trainer.logger.save_dir) == tmp_path and trainer.logger.name == directory


def test_logger_none_logs_nothing(tmp_path):
    assert built_trainer(tmp_path, "logger=none").logger is None


def test_callbacks_group_adds_lightning_callbacks(tmp_path):
    plain = built_trainer(tmp_path)
    assert not any(isinstance(c, (ModelCheckpoint, LearningRateMonitor)) for c in plain.callbacks)
    trainer = built_trainer(tmp_path, "callbacks=[model_checkpoint,lr_monitor]")
    checkpoints = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    assert len(checkpoints) == 1 and Path(checkpoints[0].dirpath) == tmp_path / "checkpoints"
    assert any(isinstance(c, LearningRateMonitor) for c in trainer.callbacks)
    assert {type(c) for c in built_trainer(tmp_path, "callbacks=default").callbacks} >= {ModelCheckpoint, LearningRateMonitor}


@pytest.mark.parametrize("override, first_line", [
    # before: accepted, ignored (the top-level trace set trace_steps=0, trace_dir=out_dir)
    ("strategy.trace_steps=2", "strategy.trace_steps=2: the job sets the strategy's trace from the top-level keys"),
    ("strategy.trace_dir=/tmp/x", "strategy.trace_dir='/tmp/x': the job sets the strategy's trace from the top-level"),
    # before: accepted, no effect
    ("+trainer.max_epoch=7", "trainer.max_epoch is not read by the fine-tuning job: it is not an argument of "
                             "lightning.pytorch.Trainer"),
    ("+trainer.strategy=ddp", "trainer.strategy is set by the job from its own config group: pick it with strategy="),
    ("+trainer.logger=false", "trainer.logger is set by the job from its own config group: pick it with logger="),
    ("+lr=1", "lr is not read by the fine-tuning job: the job reads only"),
    ("+model.revision=main", "model.revision is not read by the fine-tuning job"),
    ("+data.shuffle=false", "data.shuffle is not read by the fine-tuning job: the keys of TextDataModule are"),
    ("+callbacks.early.patience=3", "callbacks.early has no _target_"),
    ("ckpt_path=/nowhere/last.ckpt", "ckpt_path='/nowhere/last.ckpt' is not a file"),
])
def test_keys_the_job_would_ignore_are_refused_before_anything_loads(tmp_path, monkeypatch, override, first_line):
    example = load_example()

    def loads_nothing(*args, **kwargs):
        raise AssertionError("the job loaded data before checking its keys")

    monkeypatch.setattr(example, "CausalLMFineTune", loads_nothing)
    monkeypatch.setattr(example.TextDataModule, "setup", loads_nothing)
    with pytest.raises(FineTuneInputError) as err:
        example.main(compose_job(override, f"out_dir={tmp_path}"))
    assert str(err.value).startswith(first_line)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(200)
def test_ckpt_path_resumes_the_run(tmp_path):
    example = load_example()
    tiny = ("experiment=tiny", "trainer.val_check_interval=2", "logger=none")
    first = example.main(compose_job(*tiny, "trainer.max_steps=2", f"out_dir={tmp_path / 'a'}"))
    resumed = example.main(compose_job(*tiny, "trainer.max_steps=4", f"out_dir={tmp_path / 'b'}",
                                       f"ckpt_path={tmp_path / 'a' / 'last.ckpt'}"))
    assert (first["steps"], resumed["steps"]) == (2, 4)
    # "before" of the resumed run is the checkpoint's model, i.e. the first run's "after".
    assert resumed["val_ppl_before"] == pytest.approx(first["val_ppl_after"], rel=1e-6)
    state = torch.load(tmp_path / "b" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 4
    assert state["lr_schedulers"][0]["last_epoch"] == 4  # the schedule went on from step 2, not from 0


# ----------------------------------------------------------------------------- item 12: errors


@pytest.mark.timeout(200)
@pytest.mark.parametrize("args, message", [
    # before: a Traceback ending in FineTuneInputError: model.path '/nowhere/qwen3' does not exist ...
    (("model.path=/nowhere/qwen3",), "error: model.path '/nowhere/qwen3' does not exist. Set model.path to a local"),
    # each case is a Hydra job in a fresh process (about 6 s): one of each kind runs by default, the rest are slow
    pytest.param(("+trainer.max_epoch=3",), "error: trainer.max_epoch is not read by the fine-tuning job",
                 marks=pytest.mark.slow),
    (("trainer.max_stepz=3",), "Could not override 'trainer.max_stepz'."),  # Hydra's own (composition)
    pytest.param(("experiment=nope",), "Could not find 'experiment/nope'", marks=pytest.mark.slow),
])
def test_user_input_errors_print_one_message_without_a_traceback(tmp_path, args, message):
    done = job(tmp_path, *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 1
    assert message in done.stderr and "Traceback" not in done.stderr
    assert "HYDRA_FULL_ERROR=1" in done.stderr
    if message.startswith("error:"):  # the job's own errors (Hydra's come before the job and its log exist)
        assert message in (tmp_path / "run" / "finetune.log").read_text()


@pytest.mark.slow  # a Hydra job in a fresh process, about 6 s
@pytest.mark.timeout(120)
def test_hydra_full_error_shows_the_traceback(tmp_path):
    done = job(tmp_path, "model.path=/nowhere/qwen3", f"hydra.run.dir={tmp_path / 'run'}", full_error=True)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert "FineTuneInputError: model.path '/nowhere/qwen3' does not exist" in done.stderr


# ----------------------------------------------------------------------------- item 13: the log file


@pytest.mark.timeout(200)
def test_hydra_log_file_holds_the_plan_table_and_the_summary(tmp_path):
    run_dir = tmp_path / "run"
    done = job(tmp_path, "experiment=tiny", "trainer.max_steps=2", "trainer.val_check_interval=2",
               f"hydra.run.dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    log = (run_dir / "finetune.log").read_text()  # before: 0 bytes
    assert "RoundPipe pipelines `model` (Qwen3ForCausalLM)" in log and "predicted step" in log  # the plan table
    for line in ("steps:                2", "training loss (last):", "validation perplexity:", "throughput:",
                 f"checkpoint:           {run_dir / 'last.ckpt'}"):
        assert line in log
    assert "steps:                2" in done.stdout  # the console still shows it, once
    assert done.stdout.count("RoundPipe pipelines `model`") == 1 and "RoundPipe pipelines" not in done.stderr


@pytest.mark.parametrize("overrides", [(), ("trainer=gpu8",), ("strategy=default",), ("experiment=tiny",),
                                       ("experiment=tiny_lora",), ("experiment=qwen3_8b_lora_8gpu", "model.path=/m"),
                                       ("experiment=llama3_1_8b_full_8gpu", "model.path=/m"), ("callbacks=default",)])
def test_the_shipped_configs_hold_only_keys_the_job_reads(overrides):
    from lightning_roundpipe.finetune import TextDataModule
    from lightning_roundpipe.finetune.job_config import check_keys_are_read

    check_keys_are_read(compose_job(*overrides), TextDataModule)  # raises on a key the job would ignore
