"""``import lightning_roundpipe`` needs only torch, Lightning, transformers and peft: Hydra, OmegaConf and
datasets are the fine-tuning job's dependencies (the GPU machine's image has none of them)."""

import pytest

from _blocked_imports import BLOCKED, run_without_job_dependencies

IMPORT_AND_TRAIN_SETUP = """
import lightning as L
from lightning.pytorch.strategies import StrategyRegistry
import lightning_roundpipe
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.options import plain, register_configs

strategy = RoundPipeStrategy(microbatches=2, partition={"policy": "uniform"})
assert strategy.options.partition.policy == "uniform", strategy.options.partition
assert "roundpipe" in StrategyRegistry, sorted(StrategyRegistry)
trainer = L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
assert type(trainer.strategy).__name__ == "RoundPipeStrategy"
assert plain({"a": [1]}) == {"a": [1]} and register_configs() is False
import importlib
for name in %r:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError(name + " was importable: the block did not work")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in %r)
print("LOADED", loaded)
""" % (BLOCKED, BLOCKED)


@pytest.mark.timeout(300)
def test_the_strategy_imports_registers_and_builds_without_hydra_omegaconf_or_datasets():
    run = run_without_job_dependencies(IMPORT_AND_TRAIN_SETUP)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "LOADED []" in run.stdout, run.stdout
