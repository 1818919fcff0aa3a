"""The user's options are one frozen object, checked once; every part reads the frozen sub-config built from it."""

import dataclasses
import inspect
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from lightning_roundpipe import OptionError, RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.optim.overlap import OverlappedOptimizer
from lightning_roundpipe.optim.overlap_config import OverlapConfig
from lightning_roundpipe.options import EngineOptions, PartitionConfig, StrategyOptions, hydra_schema
from lightning_roundpipe.planning.keeper import PlanKeeper
from lightning_roundpipe.planning.keeper_config import KeeperConfig
from lightning_roundpipe.schedule.dispatch_order import SCHEDULES
from lightning_roundpipe.schedule.lowering import LoweringOptions
from lightning_roundpipe.workers import CpuWorkerPool

SET = dict(microbatches=3, recompute="always", timeout=7.0, staleness=1, optimizer_undo=False,
           optimizer_undo_journal_bytes=123, schedule="sticky", step_metrics=False,
           partition={"policy": "params", "memory_budget_bytes": 10**9}, transfer={"bandwidth_bytes_per_s": 5e9},
           testing={"optimizer_delay_s": 0.01})


def test_options_are_frozen_and_checked_once_when_constructed():
    options = RuntimeOptions(**SET)
    assert options.partition == PartitionConfig(policy="params", memory_budget_bytes=10**9)  # the dict, as its group
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.microbatches = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.partition.policy = "auto"
    with pytest.raises(OptionError, match=r"^RuntimeOptions\(timeout=nan\): must be a finite number > 0$"):
        RuntimeOptions(timeout=math.nan)
    with pytest.raises(OptionError, match=r"^RoundPipeStrategy\(timeout=nan\)"):
        StrategyOptions(timeout=math.nan)
    with pytest.raises(OptionError, match=r"^RuntimeOptions\(seed=-1\)"):  # a changed copy is checked too
        dataclasses.replace(options, seed=-1)


def test_the_strategy_signature_is_written_from_the_fields_not_patched():
    init = RoundPipeStrategy.__init__
    assert "__signature__" not in vars(init) and not hasattr(init, "__wrapped__")
    code = init.__code__  # the parameters are the function's own
    own = set(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
    assert {"microbatches", "schedule", "testing", "verify_checkpoints"} <= own
    assert RoundPipeStrategy(seed=3, staleness=1).options == StrategyOptions(seed=3, staleness=1)
    assert RoundPipeStrategy().options == StrategyOptions()
    with pytest.raises(TypeError, match="either options=StrategyOptions"):
        RoundPipeStrategy(StrategyOptions(), seed=3)


def test_every_part_reads_the_sub_config_built_from_the_options():
    options = RuntimeOptions(**SET)
    assert options.keeper_config(CpuWorkerPool) == KeeperConfig(
        options.partition, microbatches=3, recompute="always", compute_dtype=None, link_bytes_per_second=5e9,
        flops_per_second=CpuWorkerPool.assumed_flops_per_s, memory_budget_bytes=10**9,
        budget_option="partition.memory_budget_bytes", backend="cpu",
        microbatch_overhead_s=CpuWorkerPool.microbatch_overhead_s)
    capped = RuntimeOptions(cpu_memory_cap_bytes=2**20).keeper_config(CpuWorkerPool)
    assert (capped.memory_budget_bytes, capped.budget_option) == (2**20, "cpu_memory_cap_bytes")
    assert options.overlap_config() == OverlapConfig(staleness=1, delay_per_layer_s=0.01, early_steps=True,
                                                     timeout_s=7.0, undo=False, journal_bytes=123)
    assert options.overlap_config(early_steps=False, undo=True).undo is True

    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, options)
    try:
        assert runtime.planner.config == options.keeper_config(CpuWorkerPool)
        assert runtime.engine.options.schedule == "sticky" and runtime.engine.schedule is SCHEDULES["sticky"]
        ov = runtime.overlap_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
        read = (ov.staleness, ov.keep_undo, ov.journal_bytes, ov.timeout_s, ov.delay_per_layer_s)
        assert read == (1, False, 123, 7.0, 0.01)
    finally:
        runtime.detach()


def test_keeper_and_optimizer_take_their_sub_config_not_loose_parameters():
    assert list(inspect.signature(PlanKeeper).parameters) == ["layers", "num_workers", "config", "fused_last", "progress"]
    assert list(inspect.signature(OverlappedOptimizer).parameters) == [
        "optimizer", "config", "engine", "trace", "before_layer_step", "loss_scaler"]


def test_the_lowering_reads_the_engines_options_and_repeats_none_of_them():
    priorities = {"activation": 2, "weights": 1, "gradients": 0}
    engine = EngineOptions(microbatches=3, recompute=False, prefetch_depth=2, priorities=priorities, schedule="sticky")
    lowering = LoweringOptions(engine, fused=True)
    read = (lowering.microbatches, lowering.recompute, lowering.layer_recompute, lowering.prefetch_depth)
    assert read == (3, False, False, 2)
    assert lowering.priorities == engine.priorities and lowering.schedule is SCHEDULES["sticky"]
    own = {f.name for f in dataclasses.fields(LoweringOptions)}
    assert own == {"engine", "training", "fused", "kept_backward", "input_gradient", "first_serial"}
    assert own.isdisjoint(f.name for f in dataclasses.fields(EngineOptions))
    with pytest.raises(OptionError, match=r"^EngineOptions\(schedule='zigzag'\): use one of 'round_robin', 'sticky'$"):
        EngineOptions(schedule="zigzag")


def test_hydra_schemas_are_mutable_twins_of_the_frozen_groups():
    # Why twins: OmegaConf makes a frozen dataclass a read-only config, which YAML cannot be merged onto.
    assert OmegaConf.is_readonly(OmegaConf.structured(PartitionConfig))
    schema = hydra_schema(PartitionConfig)
    twin = [(f.name, f.default) for f in dataclasses.fields(schema)]
    assert twin == [(f.name, f.default) for f in dataclasses.fields(PartitionConfig)]
    merged = OmegaConf.merge(OmegaConf.structured(schema), {"policy": "auto", "forward_stages": 2})
    assert PartitionConfig(**OmegaConf.to_container(merged)) == PartitionConfig(policy="auto", forward_stages=2)
