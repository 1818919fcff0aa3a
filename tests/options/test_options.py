"""Options are defined once (the options package), validated at construction, and named as the caller spelled them."""

import dataclasses
import inspect
import math
import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import OmegaConf
from torch import nn

import lightning_roundpipe.engine as engine_pkg
from _models import SeqModule, fit
from lightning_roundpipe import OptionError, RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.engine.microbatch import split_microbatches
from lightning_roundpipe.options import EngineOptions, PartitionConfig, StrategyOptions, TransferConfig

CONF = Path(__file__).resolve().parents[2] / "conf"

BAD = [
    ({"microbatches": 1.5}, "microbatches=1.5"),
    ({"microbatches": True}, "microbatches=True"),
    ({"microbatches": 0}, "microbatches=0"),
    ({"timeout": math.nan}, "timeout=nan"),
    ({"timeout": math.inf}, "timeout=inf"),
    ({"timeout": 0}, "timeout=0"),
    ({"testing": {"jitter_s": -0.1}}, "testing.jitter_s=-0.1"),
    ({"testing": {"compute_delay_s": -1.0}}, "testing.compute_delay_s=-1.0"),
    ({"trace_steps": -1}, "trace_steps=-1"),
    ({"testing": {"optimizer_delay_s": math.nan}}, "testing.optimizer_delay_s=nan"),
    ({"cpu_threads_per_worker": 0}, "cpu_threads_per_worker=0"),
    ({"step_metrics": "yes"}, "step_metrics='yes'"),
    ({"transfer": {"bandwidth_bytes_per_s": -5.0}}, "transfer.bandwidth_bytes_per_s=-5.0"),
    ({"transfer": {"latency_s": -1e-5}}, "transfer.latency_s=-1e-05"),
    ({"transfer": {"chunk_bytes": 0}}, "transfer.chunk_bytes=0"),
    ({"transfer": {"priorities": {"activation": "high", "weights": 1, "gradients": 2}}},
     "the priority of 'activation' must be a number"),
    ({"transfer": {"priorities": {"activation": 0, "weights": 1, "gradients": 2, "loss": 3}}}, "unknown transfer kind(s) ['loss']"),
    ({"partition": {"forward_stages": 2.5}}, "partition.forward_stages=2.5"),
    ({"partition": {"replan_threshold": -0.5}}, "partition.replan_threshold=-0.5"),
    ({"staleness": 2}, "staleness=2"),
    ({"pinned": "sometimes"}, "pinned='sometimes'"),
]


@pytest.mark.parametrize("kwargs,message", BAD)
def test_strategy_refuses_bad_input_at_construction(kwargs, message):
    with pytest.raises(OptionError) as err:
        RoundPipeStrategy(**kwargs)
    assert f"RoundPipeStrategy({message}" in str(err.value) or message in str(err.value)
    assert str(err.value).startswith("RoundPipeStrategy(")


@pytest.mark.parametrize("kwargs,message", BAD)
def test_runtime_errors_name_runtime_options_not_the_strategy(kwargs, message):
    with pytest.raises(OptionError) as err:
        RoundPipeRuntime.attach(nn.Sequential(nn.Linear(2, 2)), "cpu", 2, RuntimeOptions(**kwargs))
    assert message in str(err.value)
    assert str(err.value).startswith("RuntimeOptions(") and "RoundPipeStrategy" not in str(err.value)


def test_checkpoint_weights_and_workers_are_checked():
    with pytest.raises(OptionError, match=r"RoundPipeStrategy\(checkpoint_weights='adapter'\): use one of 'full', 'trainable'"):
        RoundPipeStrategy(checkpoint_weights="adapter")
    with pytest.raises(OptionError, match=r"RoundPipeStrategy\(workers=0\)"):
        RoundPipeStrategy(workers=0)


def test_unknown_keyword_lists_the_options():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['micro_batches'\]; the options are \[.*'microbatches'"):
        RoundPipeStrategy(micro_batches=2)


def test_strategy_signature_is_derived_from_the_options_dataclass():
    params = inspect.signature(RoundPipeStrategy).parameters
    defaults = StrategyOptions()
    for f in dataclasses.fields(StrategyOptions):
        if f.name == "compute_dtype":  # set from the Trainer's precision, not an argument
            assert f.name not in params
            continue
        assert params[f.name].default == getattr(defaults, f.name)
    s = RoundPipeStrategy(microbatches=3, partition="uniform", transfer={"queue": "fifo"})
    assert s.options.microbatches == 3 and s.options.partition == PartitionConfig(policy="uniform")
    assert s.options.transfer.queue == "fifo"
    assert RoundPipeStrategy(StrategyOptions(microbatches=3)).options.microbatches == 3


def test_every_public_option_is_documented():
    for cls in (PartitionConfig, TransferConfig, EngineOptions, RuntimeOptions, StrategyOptions):
        doc = "".join(inspect.getdoc(c) or "" for c in cls.__mro__ if dataclasses.is_dataclass(c))
        for f in dataclasses.fields(cls):
            assert f.name in doc, f"{cls.__name__}.{f.name} has no docstring entry"


def test_engine_options_stay_importable_from_the_engine_with_their_fields():
    assert engine_pkg.EngineOptions is EngineOptions
    assert [f.name for f in dataclasses.fields(EngineOptions)] == [
        "microbatches", "recompute", "layer_recompute", "compute_dtype", "compile_layers", "recompute_early_stop",
        "early_stop_required", "priorities", "chunk_bytes", "prefetch_depth", "measure_tasks", "schedule"]
    with pytest.raises(OptionError, match=r"EngineOptions\(prefetch_depth=-1\)"):
        EngineOptions(prefetch_depth=-1).validate()


def test_engine_options_refuse_the_early_stop_without_compiled_layers():
    with pytest.raises(OptionError, match=r"EngineOptions\(recompute_early_stop=True\): the early-stopping recompute "
                                          r"is a compiled graph"):
        EngineOptions(recompute_early_stop=True).validate()
    assert EngineOptions(recompute_early_stop=True, compile_layers=True).validate().recompute_early_stop
    eng = RuntimeOptions(recompute_early_stop=True).validate().engine_options(num_workers=2, compile_layers=True)
    assert eng.recompute_early_stop and eng.compile_layers and eng.early_stop_required


def test_the_early_stop_default_follows_compiled_layers_and_never_fails_a_step():
    """None (default): on exactly where layers run compiled, a layer that cannot stop early recomputing whole
    (not required); False: off; True: on and required."""
    opts = RuntimeOptions().validate()
    assert opts.recompute_early_stop is None
    on = opts.engine_options(num_workers=2, compile_layers=True)
    assert (on.recompute_early_stop, on.early_stop_required) == (True, False)
    off = opts.engine_options(num_workers=2, compile_layers=False)
    assert (off.recompute_early_stop, off.compile_layers) == (False, False)
    assert not RuntimeOptions(compile_layers=True).validate().engine_options(num_workers=2).early_stop_required
    assert RuntimeOptions(compile_layers=True).validate().engine_options(num_workers=2).recompute_early_stop
    assert not RuntimeOptions(recompute_early_stop=False).validate().engine_options(
        num_workers=2, compile_layers=True).recompute_early_stop
    with pytest.raises(OptionError, match="must be True or False"):
        EngineOptions(early_stop_required=None).validate()


def test_runtime_options_give_the_engine_its_share():
    opts = RuntimeOptions(transfer=TransferConfig(chunk_bytes=1024, prefetch_depth=2), recompute="never")
    eng = opts.validate().engine_options(num_workers=3)
    assert (eng.microbatches, eng.recompute, eng.chunk_bytes, eng.prefetch_depth) == (4, False, 1024, 2)


# ------------------------------------------------------------------ Hydra
def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_hydra_groups_extend_the_structured_configs():
    cfg = _compose()
    strategy = OmegaConf.to_container(cfg.strategy)
    target = strategy.pop("_target_")
    assert target == "lightning_roundpipe.RoundPipeStrategy"
    defaults = StrategyOptions()
    skipped = {"partition", "transfer", "compute_dtype"}
    assert set(strategy) == {f.name for f in dataclasses.fields(StrategyOptions)} - skipped
    expected = {k: getattr(defaults, k) for k in strategy} | {"testing": dataclasses.asdict(defaults.testing)}
    assert strategy == expected  # the YAML shows the defaults, never other values
    assert OmegaConf.to_container(cfg.transfer) == dataclasses.asdict(TransferConfig())
    assert set(cfg.partition) == {f.name for f in dataclasses.fields(PartitionConfig)}
    built = RoundPipeStrategy(**strategy, partition=cfg.partition, transfer=cfg.transfer)
    assert built.options.partition == PartitionConfig() and built.options.transfer == TransferConfig()
    assert (built.options.partition.policy, built.options.recompute, built.options.microbatches) == ("compute", "auto", None)


@pytest.mark.parametrize("override,key", [("strategy.microbatches=1.5", "microbatches"),
                                          ("transfer.latency_s=fast", "latency_s"),
                                          ("partition.forward_stages=two", "forward_stages")])
def test_hydra_refuses_mistyped_options_naming_them(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        _compose(override)
    assert key in str(err.value) + str(err.value.__cause__)


def test_hydra_values_are_validated_like_keywords():
    cfg = _compose("transfer.latency_s=-1.0")
    with pytest.raises(OptionError, match=r"transfer.latency_s=-1.0"):
        RoundPipeStrategy(transfer=cfg.transfer)


# ------------------------------------------------------------------ batches and workers
@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    weight: torch.Tensor
    tag: str = "train"


class Unpack(nn.Module):
    def forward(self, b: Batch):
        assert isinstance(b, Batch) and b.tag == "train"
        return b.x * b.weight


def test_dataclass_batch_is_split_like_a_dict():
    x, w = torch.randn(5, 3), torch.rand(5, 1)
    parts = split_microbatches(Batch(x, w), 2)
    as_dict = split_microbatches({"x": x, "weight": w, "tag": "train"}, 2)
    assert [type(p) for p in parts] == [Batch, Batch]
    for p, d in zip(parts, as_dict):
        assert torch.equal(p.x, d["x"]) and torch.equal(p.weight, d["weight"]) and p.tag == d["tag"]


def test_dataclass_batch_trains_through_the_pipeline_exactly():
    torch.manual_seed(0)
    net = nn.Sequential(Unpack(), nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = [p.detach().clone() for p in net.parameters()]
    batch = Batch(torch.randn(6, 3), torch.rand(6, 1))
    plain = nn.Sequential(*[m for m in net])
    plain.zero_grad()
    plain(batch).square().mean().backward()
    expected = [p.grad.clone() for p in plain.parameters()]
    net.zero_grad()
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=3, step_metrics=False))
    try:
        net(batch).square().mean().backward()
    finally:
        runtime.detach()
    for p, g, w in zip(net.parameters(), expected, ref):
        assert torch.equal(p, w)
        assert (p.grad - g).norm() <= 1e-5 * g.norm()


def test_one_worker_warns_and_says_how_to_ask_for_more():
    # Recorded, not pytest.warns (which re-emits the third-party warnings the config filters).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(SeqModule(), "roundpipe", devices=1, max_steps=1)
    ours = [str(w.message) for w in caught if "lightning_roundpipe" in w.filename]
    assert len(ours) == 1 and re.search(r"one worker, which cannot pipeline.*devices=N", ours[0])
    trainer = L.Trainer(strategy="roundpipe", accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_steps=1)
    with pytest.warns(UserWarning, match="devices=N"):
        trainer.strategy.setup_environment()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, logger=False).strategy.setup_environment()


def test_registered_with_a_description():
    assert "roundpipe" in StrategyRegistry.available_strategies()
    assert "round-robin" in StrategyRegistry["roundpipe"]["description"]


def test_runtime_hands_host_state_to_the_engine_at_construction():
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, staleness=1, step_metrics=False))
    try:
        assert runtime.engine.shadows is runtime.shadows and runtime.shadows is not None
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ov = runtime.overlap_optimizer(opt, early_steps=False)
        assert ov.staleness == 1 and ov.early_steps is False
        with pytest.raises(OptionError, match=r"overlap_optimizer\(staleness=0\).*RuntimeOptions\(staleness=1\)"):
            runtime.overlap_optimizer(torch.optim.SGD(net.parameters(), lr=0.1), staleness=0)
    finally:
        runtime.detach()
    plain = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    try:
        assert plain.shadows is None and plain.engine.shadows is None
    finally:
        plain.detach()


@pytest.mark.timeout(30)
def test_schedule_option_names_the_schedules():
    assert RoundPipeStrategy(schedule="sticky").options.schedule == "sticky"
    assert RuntimeOptions().schedule == "round_robin"
    with pytest.raises(OptionError, match=r"^RoundPipeStrategy\(schedule='zigzag'\): use one of 'round_robin', 'sticky'$"):
        RoundPipeStrategy(schedule="zigzag")
    assert "schedule: round_robin" in (CONF / "strategy" / "roundpipe.yaml").read_text()
