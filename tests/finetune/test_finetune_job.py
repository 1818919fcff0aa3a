"""The fine-tuning job: Hydra composition of conf/, smoke runs of examples/finetune.py, and the
shipped tiny models (they load, and fine-tuning lowers their validation perplexity)."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_roundpipe import assets
from lightning_roundpipe.finetune import CausalLMFineTune, TextDataModule
from lightning_roundpipe.finetune.config import register_resolvers

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"

register_resolvers()


def compose_job(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def load_example():
    spec = importlib.util.spec_from_file_location("finetune_example", REPO / "examples" / "finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quiet_trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


# ----------------------------------------------------------------------------- composition


def test_default_config_composes_to_documented_values():
    cfg = compose_job()
    assert cfg.model.path == str(assets.path("tiny-qwen3"))
    assert cfg.model.tokenizer is None
    assert OmegaConf.to_container(cfg.data) == {
        "text_path": None, "format": "text", "text_field": "text", "packing": False, "seq_len": 128, "batch_size": 8,
        "val_fraction": 0.1, "padded": False,
    }
    assert cfg.strategy._target_ == "lightning_roundpipe.RoundPipeStrategy"
    assert OmegaConf.to_container(cfg.strategy) == {
        "_target_": "lightning_roundpipe.RoundPipeStrategy", "microbatches": None, "recompute": "auto",
        "timeout": 300, "module": None, "staleness": 0, "overlap_optimizer": None, "pinned": "alloc",
        # the rest of lightning_roundpipe.options.StrategyOptions, which the YAML extends (defaults)
        "cpu_threads_per_worker": 1, "cpu_reuse_freed_memory": True, "seed": 0, "trace_steps": 0,
        "step_metrics": True, "workers": None, "trace_dir": None, "checkpoint_weights": "full",
        "progress_bar_metrics": False, "log_step_metrics": True, "verify_checkpoints": False,
        "allow_unverified": False, "logits_with_loss": False, "optimizer_undo": True, "optimizer_undo_journal_bytes": 4 << 30, "overlap_calls": True, "cpu_memory_cap_bytes": None,
        "batch_statistics": "refuse", "split_check": True,
        "schedule": "round_robin",
        "moe_experts": "hf", "gc_freeze": True,
        "compile_layers": None, "recompute_early_stop": None, "fp16_accumulation": False,
        "testing": {"compute_delay_s": 0.0, "jitter_s": 0.0, "optimizer_delay_s": 0.0},
    }
    assert cfg.partition.policy == "compute"
    assert set(cfg.partition) >= {"policy", "forward_stages", "backward_stages", "manual_forward", "manual_backward", "replan_threshold"}
    assert OmegaConf.to_container(cfg.transfer.priorities) == {"activation": 0, "weights": 1, "gradients": 2}
    assert cfg.transfer.bandwidth_bytes_per_s is None and cfg.transfer.latency_s == 0.0
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.precision) == ("cpu", 2, "32-true")
    assert cfg.trainer.max_steps == 40
    assert cfg.lora.enabled is False
    # Outputs go to Hydra's run directory in a Hydra run, to outputs/finetune when composed by hand.
    assert (cfg.seed, cfg.out_dir, cfg.trace, cfg.trace_steps) == (0, "outputs/finetune", False, 2)
    assert OmegaConf.to_container(cfg)["out_dir"] == "${run_dir:outputs/finetune}"
    assert OmegaConf.missing_keys(cfg) == set()


def test_documented_override_line_composes():
    cfg = compose_job("model=tiny_llama", "strategy.microbatches=4", "trainer.max_steps=20", "lora=on")
    assert cfg.model.path == str(assets.path("tiny-llama"))
    assert cfg.strategy.microbatches == 4
    assert cfg.trainer.max_steps == 20
    assert OmegaConf.to_container(cfg.lora) == {
        "enabled": True, "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]
    }
    # Everything not overridden keeps its default.
    assert cfg.trainer.accelerator == "cpu" and cfg.partition.policy == "compute"


@pytest.mark.parametrize("model", ["qwen3_0_6b", "qwen3_1_7b", "qwen3_8b", "llama3_1_8b"])
def test_real_models_require_a_local_path(model):
    cfg = compose_job(f"model={model}")
    assert OmegaConf.missing_keys(cfg) == {"model.path"}
    given = compose_job(f"model={model}", "model.path=/models/x")
    assert given.model.path == "/models/x" and OmegaConf.missing_keys(given) == set()


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("strategy=default", "strategy", {"name": "single_device", "devices": 1}),
        ("partition=uniform", "partition.policy", "uniform"),
        ("partition=auto", "partition.policy", "auto"),
        ("transfer=fifo", "transfer.priorities", {"activation": 0, "weights": 0, "gradients": 0}),
        ("transfer=fifo", "transfer.queue", "fifo"),
        ("transfer=pcie4", "transfer.bandwidth_bytes_per_s", 25_000_000_000),
        ("transfer=pcie4", "transfer.latency_s", 1e-5),
        ("trainer=gpu8", "trainer", {
            "accelerator": "gpu", "devices": 8, "max_steps": 1000, "precision": "bf16-mixed", "log_every_n_steps": 10,
            "val_check_interval": 200, "limit_val_batches": 50, "accumulate_grad_batches": 1, "gradient_clip_val": 1.0,
        }),
        ("data.padded=true", "data.padded", True),
    ],
)
def test_group_options_compose(override, key, expected):
    value = OmegaConf.select(compose_job(override), key)
    assert (OmegaConf.to_container(value) if OmegaConf.is_config(value) else value) == expected


def test_manual_partition_needs_ranges():
    cfg = compose_job("partition=manual")
    assert OmegaConf.missing_keys(cfg) == {"partition.manual_forward"}
    cfg = compose_job("partition=manual", "partition.manual_forward=[[0,3],[3,6]]")
    assert OmegaConf.to_container(cfg.partition.manual_forward) == [[0, 3], [3, 6]]


# ----------------------------------------------------------------------------- smoke runs


def smoke_overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2",
        f"out_dir={tmp_path}",
        *extra,
    ]


@pytest.mark.slow
def test_example_runs_three_steps_with_lightning_default_strategy(tmp_path):
    results = load_example().main(compose_job(*smoke_overrides(tmp_path, "strategy=default", "lora=on")))
    assert results["steps"] == 3
    assert math.isfinite(results["train_loss"]) and 1.0 < results["train_loss"] < 4.0
    assert 10.0 < results["val_ppl_after"] < results["val_ppl_before"] < 40.0
    assert results["tokens_per_s"] > 0
    assert (tmp_path / "last.ckpt").is_file()
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 3


@pytest.mark.slow
def test_example_runs_three_steps_with_roundpipe_like_the_default_strategy(tmp_path):
    example = load_example()
    reference = example.main(compose_job(*smoke_overrides(tmp_path / "ref", "strategy=default")))
    piped = example.main(compose_job(*smoke_overrides(tmp_path / "rp", "strategy.microbatches=4")))
    assert piped["steps"] == 3
    assert (tmp_path / "rp" / "last.ckpt").is_file()
    # Exact by default: in fp32 the pipeline trains what the single-device run trains.
    assert piped["val_ppl_before"] == pytest.approx(reference["val_ppl_before"], rel=1e-5)
    assert piped["val_ppl_after"] == pytest.approx(reference["val_ppl_after"], rel=1e-4)
    assert piped["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-4)


@pytest.mark.parametrize(
    "max_steps, accumulate, batches, expected",
    [(40, 1, 52, 1), (52, 1, 52, 1), (53, 1, 52, 2), (40, 4, 52, 4), (1000, 1, 52, 20), (-1, 1, 52, None)],
)
def test_max_epochs_covers_max_steps(max_steps, accumulate, batches, expected):
    assert load_example().epochs_for(max_steps, accumulate, batches) == expected


# Warning lines the default job may still print, each from third-party code, with why.
ALLOWED_JOB_WARNINGS: dict[str, str] = {}  # file suffix -> message part of third-party warnings we cannot avoid
WARNING_LINE = re.compile(r"^(?P<file>\S+\.py):\d+: (?P<message>.*)$")


def job_env() -> dict[str, str]:
    src = str(REPO / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.slow
def test_default_job_prints_no_warning_of_ours_and_a_sensible_epoch(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-W", "default", str(REPO / "examples" / "finetune.py"), f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    output = (done.stdout + "\n" + done.stderr).replace("\r", "\n")
    shown = []
    for line in output.splitlines():
        match = WARNING_LINE.match(line.strip())
        if match or "Warning" in line:
            shown.append(line.strip())
    unexpected = [
        line for line in shown
        if not any(line.split(":")[0].endswith(file) and message in line for file, message in ALLOWED_JOB_WARNINGS.items())
    ]
    assert unexpected == []
    assert output.count("RoundPipe pipelines `") == 1  # validate, fit, validate: one plan table
    assert "RoundPipe: " not in output  # no set-up progress bar when the output is not a terminal
    assert re.search(r"Epoch 0/0\b", done.stdout) and "Epoch 0/-" not in output
    assert "steps:                40" in done.stdout
    # Outputs land in Hydra's run directory.
    assert (run_dir / "last.ckpt").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()


# ----------------------------------------------------------------------------- shipped models


@pytest.mark.parametrize("name, model_type", [("tiny-qwen3", "qwen3"), ("tiny-llama", "llama")])
def test_shipped_tiny_models_load_with_from_pretrained(name, model_type):
    model = AutoModelForCausalLM.from_pretrained(assets.path(name))
    tokenizer = AutoTokenizer.from_pretrained(assets.path(name))
    config = model.config
    assert config.model_type == model_type
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (64, 4, 4, 2)
    assert (config.vocab_size, config.max_position_embeddings, config.tie_word_embeddings) == (512, 512, False)
    assert len(tokenizer) == 512 and tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    text = "To be, or not to be: that is the question.\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    # A pretrained model, not a random one: far below the uniform loss ln(512) = 6.24.
    ids = tokenizer(assets.path("shakespeare.txt").read_text()[:2000], return_tensors="pt")["input_ids"][:, :256]
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss.item() < 4.0


def test_assets_are_small_and_resolve():
    assert assets.names() == ["chat_tiny.jsonl", "shakespeare.txt", "text_tiny.jsonl", "text_tiny.parquet", "tiny-llama",
                             "tiny-qwen3", "tiny_chat_template.jinja"]
    assert assets.path("shakespeare.txt").stat().st_size == 200_376
    total = sum(p.stat().st_size for p in assets.ASSETS_DIR.rglob("*") if p.is_file())
    assert total < 3_000_000
    with pytest.raises(KeyError, match="known assets"):
        assets.path("gpt-5")


def test_val_ppl_is_exp_of_token_weighted_loss_and_falls_when_fine_tuning():
    pl.seed_everything(0)
    path = assets.path("tiny-qwen3")
    data = TextDataModule(path, seq_len=64, batch_size=8, padded=True)
    module = CausalLMFineTune(path, optim={"lr": 3e-4, "schedule": "constant"})
    trainer = quiet_trainer(max_steps=8, limit_val_batches=4)

    before = trainer.validate(module, datamodule=data, verbose=False)[0]
    # By hand: loss per batch times its target tokens, summed, over the total target tokens.
    weighted, tokens = 0.0, 0
    with torch.no_grad():
        for index, batch in enumerate(data.val_dataloader()):
            if index == 4:
                break
            count = int((batch["labels"][:, 1:] != -100).sum())
            weighted += module.model(**batch).loss.item() * count
            tokens += count
    assert before["val_ppl"] == pytest.approx(math.exp(weighted / tokens), rel=1e-5)
    assert before["val_loss"] == pytest.approx(weighted / tokens, rel=1e-5)

    trainer.fit(module, datamodule=data)
    after = trainer.validate(module, datamodule=data, verbose=False)[0]
    assert after["val_ppl"] < before["val_ppl"] - 0.1


def test_padded_samples_mask_and_ignore_the_padding():
    data = TextDataModule(assets.path("tiny-qwen3"), seq_len=32, batch_size=4, padded=True, seed=3)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    mask, ids, labels = batch["attention_mask"], batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape == mask.shape == (4, 32)
    lengths = mask.sum(dim=1)
    assert bool((lengths >= 16).all()) and bool((lengths < 32).any())
    pad = data.tokenizer.pad_token_id
    for row, length in enumerate(lengths.tolist()):
        assert bool((mask[row, :length] == 1).all()) and bool((mask[row, length:] == 0).all())
        assert bool((labels[row, :length] == ids[row, :length]).all())
        assert bool((labels[row, length:] == -100).all()) and bool((ids[row, length:] == pad).all())


def test_data_split_holds_the_end_of_the_text_for_validation():
    data = TextDataModule(assets.path("tiny-qwen3"), seq_len=128, batch_size=8, val_fraction=0.1)
    data.setup("fit")
    ids = data.tokenizer(assets.path("shakespeare.txt").read_text(), verbose=False)["input_ids"]
    blocks = len(ids) // 128
    assert (len(data.train_set), len(data.val_set)) == (blocks - round(blocks * 0.1), round(blocks * 0.1))
    assert data.val_set.input_ids[-1].tolist() == ids[(blocks - 1) * 128 : blocks * 128]
    assert bool((data.train_set.labels == data.train_set.input_ids).all())
    assert len(data.train_dataloader()) == len(data.train_set) // 8  # full batches only


def test_make_tiny_models_retrains_the_shipped_tokenizer_exactly(monkeypatch):
    spec = importlib.util.spec_from_file_location("make_tiny_models", REPO / "scripts" / "make_tiny_models.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "make_tiny_models", script)  # its dataclasses look themselves up there
    spec.loader.exec_module(script)
    retrained = script.train_tokenizer(assets.path("shakespeare.txt").read_text(encoding="utf-8"))
    shipped = AutoTokenizer.from_pretrained(assets.path("tiny-qwen3"))
    assert retrained.get_vocab() == shipped.get_vocab()
    assert script.common_shape(retrained)["vocab_size"] == 512
