"""Hydra conventions of the fine-tuning job (lightning-hydra-template style): `experiment=`
presets, `--multirun` sweeps on the CPU, `--cfg job`, and outputs in Hydra's run directory."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_roundpipe import RoundPipeStrategy, assets
from lightning_roundpipe.finetune.config import RUN_DIR_NOT_YET, register_resolvers, run_dir

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))

register_resolvers()


def compose_job(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def job(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    src = str(REPO / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "finetune.py"), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_the_documented_presets_exist():
    assert PRESETS == ["llama3_1_8b_full_8gpu", "qwen3_8b_lora_8gpu", "tiny", "tiny_lora"]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_resolves_and_its_strategy_options_are_accepted(preset):
    cfg = compose_job(f"experiment={preset}", "model.path=/models/x", "out_dir=/tmp/x")
    resolved = OmegaConf.to_container(cfg, resolve=True)  # raises on any broken interpolation
    assert OmegaConf.missing_keys(cfg) == set()
    options = {k: v for k, v in resolved["strategy"].items() if k != "_target_"}
    assert set(options) <= set(inspect.signature(RoundPipeStrategy).parameters)


def test_presets_set_what_their_names_say():
    tiny = compose_job("experiment=tiny")
    assert (tiny.trainer.accelerator, tiny.trainer.devices, tiny.trainer.max_steps) == ("cpu", 2, 5)
    assert tiny.lora.enabled is False and "tiny-qwen3" in tiny.model.path
    assert OmegaConf.missing_keys(tiny) == set()  # runs with nothing else given

    lora = compose_job("experiment=tiny_lora")
    assert lora.lora.enabled is True and "tiny-llama" in lora.model.path and lora.trainer.accelerator == "cpu"

    qwen = compose_job("experiment=qwen3_8b_lora_8gpu")
    assert OmegaConf.missing_keys(qwen) == {"model.path"}  # a real model must be given
    assert (qwen.trainer.accelerator, qwen.trainer.devices, qwen.trainer.precision) == ("gpu", 8, "bf16-mixed")
    assert (qwen.lora.enabled, qwen.lora.r, qwen.partition.policy) == (True, 16, "auto")
    assert (qwen.data.seq_len, qwen.data.batch_size, qwen.strategy.microbatches) == (4096, 16, 16)

    llama = compose_job("experiment=llama3_1_8b_full_8gpu")
    assert OmegaConf.missing_keys(llama) == {"model.path"}
    assert (llama.trainer.devices, llama.trainer.precision, llama.lora.enabled) == (8, "bf16-mixed", False)
    assert llama.model.dtype is None and llama.optim.lr == 1e-5 and llama.partition.policy == "auto"


def test_run_dir_outside_a_hydra_run_is_the_fallback():
    assert run_dir("outputs/finetune") == "outputs/finetune"
    assert compose_job("experiment=tiny").out_dir == "outputs/finetune"


def test_command_line_overrides_win_over_the_preset():
    cfg = compose_job("experiment=tiny", "trainer.max_steps=7", "lora=on")
    assert cfg.trainer.max_steps == 7 and cfg.lora.enabled is True and cfg.trainer.val_check_interval == 5


@pytest.mark.slow
def test_cfg_job_prints_the_composed_config_and_trains_nothing(tmp_path):
    done = job(tmp_path, "--cfg", "job", "experiment=qwen3_8b_lora_8gpu", "strategy.microbatches=12")
    assert done.returncode == 0, done.stderr[-2000:]
    printed = OmegaConf.create(done.stdout)
    assert printed.strategy.microbatches == 12 and printed.lora.r == 16 and printed.trainer.devices == 8
    assert OmegaConf.is_missing(printed.model, "path")
    assert "hydra" not in printed  # `--cfg job` leaves Hydra's own settings out
    assert list(tmp_path.iterdir()) == []  # no run directory, no checkpoint


@pytest.mark.slow
def test_cfg_job_resolve_shows_the_asset_paths_and_trains_nothing(tmp_path):
    resolved = job(tmp_path, "--cfg", "job", "--resolve", "experiment=tiny")
    assert resolved.returncode == 0, resolved.stderr[-2000:]
    printed = OmegaConf.create(resolved.stdout)
    assert printed.model.path == str(assets.path("tiny-qwen3"))  # ${asset:...} resolved
    assert printed.out_dir == RUN_DIR_NOT_YET and printed.trainer.max_steps == 5
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_two_point_multirun_on_cpu_writes_one_run_directory_per_job_with_equal_results(tmp_path):
    sweep = tmp_path / "sweep"
    done = job(
        tmp_path, "--multirun", "experiment=tiny", "strategy.microbatches=2,4", "trainer.max_steps=2",
        "trainer.val_check_interval=2", f"hydra.sweep.dir={sweep}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (sweep / "multirun.yaml").is_file()
    losses = [float(v) for v in re.findall(r"training loss \(last\): (\S+)", done.stdout)]
    assert len(losses) == 2
    for num, microbatches in enumerate((2, 4)):
        run = sweep / str(num)
        assert f"strategy.microbatches={microbatches}" in (run / ".hydra" / "overrides.yaml").read_text()
        assert OmegaConf.load(run / ".hydra" / "config.yaml").strategy.microbatches == microbatches
        assert torch.load(run / "last.ckpt", weights_only=False)["global_step"] == 2
        assert (run / "logs").is_dir()
    # Exact in fp32 whatever the microbatch count: the two jobs train the same model.
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
