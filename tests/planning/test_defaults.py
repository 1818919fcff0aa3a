"""The choices made when options are left open: the compute-weighted partition, the microbatch
count from the plan, recompute "auto", and the host's work in the predicted step (hand-computed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.options import OptionError, PartitionConfig, register_configs
from lightning_roundpipe.planning.defaults import (HOST_COPY_BYTES_PER_SECOND, HOST_LOSS_SECONDS_PER_ELEMENT,
                                                   choose_microbatches, choose_recompute, estimate_host_work,
                                                   host_memory_budget, no_recompute_peak_bytes, rescaled)
from lightning_roundpipe.planning.keeper import PlanKeeper
from lightning_roundpipe.planning.keeper_config import KeeperConfig
from lightning_roundpipe.planning.partition import partition, predict
from lightning_roundpipe.planning.predictor import HostWork
from lightning_roundpipe.planning.report import build_report
from lightning_roundpipe.schedule.plan import Plan

CONF = Path(__file__).resolve().parents[2] / "conf"


def lc(forward_s: float, weight_bytes: int, act: int = 4, graph: int | None = None) -> LayerCost:
    return LayerCost(forward_s, forward_s, 2 * forward_s, weight_bytes, weight_bytes, act, graph_bytes_per_token=graph)


def embedding_block_head() -> CostProfile:
    """An embedding (a gather: no compute) and a head of the same size (a matmul: 3 s), a block between."""
    return CostProfile([lc(0.0, 6), lc(1.0, 2), lc(3.0, 6)], tokens_per_microbatch=1)


# ------------------------------------------------------------------ compute-weighted partition
def test_compute_policy_cuts_before_the_head_not_after_the_embedding():
    # 2 workers, 2 microbatches, no recompute (backward 2x forward), no per-stage overhead, free links.
    # By hand (list schedule, backward after the whole forward):
    #   F 0:3             : forward 0-8 on worker 0, backward 8-24 on worker 1          -> 24
    #   F 0:1 1:3         : F1 (4 per microbatch) ends 8, B1 (8 each) 8-24, B0 ends 24   -> 24
    #   F 0:2 2:3         : F0 1 each, F1 3 each ends 7, B1 (6 each) 7-19, B0 13-15, 19-21 -> 21
    #   F 0:1 1:2 2:3     : F2 ends 7, B2 7-19, B1 13-15, 19-21, B0 21                  -> 21
    # the fastest two tie; the fewer stages win: the head alone, the embedding with the block.
    costs = embedding_block_head()
    plan = partition("compute", costs, 2, 2, recompute=False, stage_overhead_s=0.0)
    assert plan.to_text() == "F 0:2 2:3 | B 0:2 2:3"
    assert plan.facts.predicted_step_s == pytest.approx(21.0)
    assert plan.facts.policy == "compute"
    for cuts, step in ((((0, 3),), 24.0), (((0, 1), (1, 3)), 24.0), (((0, 1), (1, 2), (2, 3)), 21.0)):
        other = Plan(3, cuts, cuts)
        assert predict(other, costs, 2, 2, stage_overhead_s=0.0, recompute=False).step_s == pytest.approx(step)
    # Equal weight bytes put the embedding alone and the block with the head: 3 s slower.
    params = partition("params", costs, 2, 2, recompute=False, stage_overhead_s=0.0)
    assert params.to_text() == "F 0:1 1:3 | B 0:1 1:3"


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def sequential_lm(vocab=384, hidden=16, blocks=4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(vocab, hidden), *[Block(hidden) for _ in range(blocks)], nn.Linear(hidden, vocab))


def test_default_keeper_weighs_the_embedding_as_a_gather_and_the_head_as_a_matmul():
    net = sequential_lm(3072, 128, 4)  # embedding and head hold 3072 x 128 weights each; the head costs 3 blocks' FLOPs
    keeper = PlanKeeper(list(net), 2, KeeperConfig(PartitionConfig(), flops_per_second=5e10), fused_last=False)
    stages = keeper.plan.forward
    head_stage = next(r for r in stages if r[1] == 6)
    embedding_stage = next(r for r in stages if r[0] == 0)
    assert keeper.plan.to_text() == "F 0:2 2:5 5:6 | B 0:2 2:5 5:6"
    assert head_stage == (5, 6)  # the head alone ...
    assert embedding_stage[1] - embedding_stage[0] >= 2  # ... the embedding shares its stage with blocks
    assert (keeper.recompute, keeper.replanner) == (False, None)  # CPU, no budget: keep graphs; planned once
    params = PlanKeeper(list(net), 2, KeeperConfig(PartitionConfig(policy="params"), flops_per_second=5e10),
                        fused_last=False)
    assert params.plan.to_text() == "F 0:3 3:6 | B 0:3 3:6"  # equal bytes: the head with two blocks, 5 blocks' work
    again = PlanKeeper(list(sequential_lm(3072, 128, 4)), 2, KeeperConfig(PartitionConfig(), flops_per_second=5e10), fused_last=False)
    assert (again.plan.to_text(), again.microbatches) == (keeper.plan.to_text(), keeper.microbatches)  # deterministic


# ------------------------------------------------------------------ microbatches from the plan
def test_microbatch_count_from_the_plan_hand_computed():
    # Two layers of 1 s forward for the whole step's 8 tokens, one stage each, no recompute. With
    # M microbatches every task takes 1/M (forward) or 2/M (backward):
    #   forward ends (M + 1) / M, the last backward stage ends (M + 1) / M + 2 (M + 1) / M = 3 + 3 / M
    #   M = 2: 4.5, M = 4: 3.75, M = 8: 3.375 -> 8 (4 is 11% slower, outside the 2% tie)
    costs = CostProfile([lc(1.0, 10), lc(1.0, 10)], tokens_per_microbatch=8)
    seen = {}

    def step(profile, m):
        plan = partition("manual", profile, 2, m, recompute=False, stage_overhead_s=0.0,
                         manual_forward=[[0, 1], [1, 2]])
        seen[m] = plan.facts.predicted_step_s
        return seen[m]

    assert choose_microbatches(costs, 2, 8, step) == 8
    assert seen == {2: pytest.approx(4.5), 4: pytest.approx(3.75), 8: pytest.approx(3.375)}
    assert rescaled(costs, 2).layers[0].forward_s == pytest.approx(0.25)


def test_microbatch_count_takes_the_fewest_within_the_tie_tolerance():
    predicted = {3: 1.0, 6: 0.95, 12: 0.94}  # 12 is only 1.1% faster than 6
    assert choose_microbatches(embedding_block_head(), 3, 12, lambda _, m: predicted[m]) == 6
    predicted[12] = 0.9  # now 5.3% faster
    assert choose_microbatches(embedding_block_head(), 3, 12, lambda _, m: predicted[m]) == 12


# ------------------------------------------------------------------ recompute auto
def test_recompute_auto_keeps_graphs_only_on_cpu_when_they_fit():
    costs = CostProfile([lc(1.0, 100, graph=10), lc(1.0, 300, graph=20), lc(1.0, 200, graph=5)], tokens_per_microbatch=4)
    # graphs of all layers for 3 microbatches: 3 * (10 + 20 + 5) * 4 tokens = 420; two largest states
    # (weights + gradients): 600 + 400 = 1000
    assert no_recompute_peak_bytes(costs, 3) == 1420
    assert choose_recompute("auto", "cpu", costs, 3, None) is False
    assert choose_recompute("auto", "cpu", costs, 3, 1420) is False
    assert choose_recompute("auto", "cpu", costs, 3, 1419) is True
    assert choose_recompute("auto", "cuda", costs, 3, None) is True
    assert choose_recompute("always", "cpu", costs, 3, None) is True
    assert choose_recompute("never", "cpu", costs, 3, 1) is False
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert host_memory_budget() == total // 2


def test_recompute_auto_recomputes_when_the_user_cut_backward_differently():
    net = sequential_lm()

    def recomputes(partition: PartitionConfig) -> bool:
        config = KeeperConfig(partition, microbatches=2, recompute="auto", flops_per_second=5e10)
        return PlanKeeper(list(net), 2, config, fused_last=False).recompute

    manual = PartitionConfig(policy="manual", manual_forward=[[0, 3], [3, 6]], manual_backward=[[0, 2], [2, 4], [4, 6]])
    assert recomputes(manual) is True
    same = PartitionConfig(policy="manual", manual_forward=[[0, 3], [3, 6]])
    assert recomputes(same) is False
    counted = PartitionConfig(policy="params", forward_stages=2, backward_stages=4)
    assert recomputes(counted) is True
    assert recomputes(PartitionConfig(policy="params")) is False


def test_runtime_resolves_the_open_options():
    net = sequential_lm()
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(step_metrics=False))
    try:
        assert runtime.engine.options.recompute is False
        assert runtime.engine.options.microbatches == runtime.planner.microbatches in (2, 4, 8)
        assert runtime.planner.plan.facts.policy == "compute"
    finally:
        runtime.detach()
    tight = RuntimeOptions(partition=PartitionConfig(memory_budget_bytes=1), step_metrics=False, microbatches=3)
    with pytest.raises(Exception, match="memory budget|needs"):  # a 1-byte budget fits no layer at all
        RoundPipeRuntime.attach(sequential_lm(), "cpu", 2, tight)


def test_recompute_auto_takes_the_cpu_memory_cap_as_its_budget():
    from lightning_roundpipe.planning.defaults import no_recompute_peak_bytes

    def attached(cap):
        return RoundPipeRuntime.attach(sequential_lm(), "cpu", 2, RuntimeOptions(step_metrics=False, microbatches=4,
                                                                                 cpu_memory_cap_bytes=cap))

    runtime = attached(None)
    try:  # no cap: the kept graphs fit half the host's memory
        assert runtime.engine.options.recompute is False
        kept = no_recompute_peak_bytes(runtime.planner.moving.profile(), 4)
    finally:
        runtime.detach()
    runtime = attached(kept - 1)  # a virtual GPU one byte too small for the kept graphs: recompute
    try:
        assert runtime.engine.options.recompute is True
    finally:
        runtime.detach()


# ------------------------------------------------------------------ host work in the predicted step
def test_host_work_is_priced_into_the_predicted_step_by_hand():
    costs = embedding_block_head()
    plan = Plan(3, ((0, 2), (2, 3)), ((0, 2), (2, 3)))
    host = HostWork(between_s=0.5, outside_s=0.25)
    # F1 ends 7; the backward starts 7.5: B1 7.5-13.5, 13.5-19.5; B0 13.5-15.5, 19.5-21.5; + 0.25 between steps
    p = predict(plan, costs, 2, 2, stage_overhead_s=0.0, recompute=False, host=host)
    assert p.step_s == pytest.approx(21.75)
    assert p.host_s == pytest.approx(0.75)
    report = build_report(plan, costs, 2, 2, stage_overhead_s=0.0, recompute=False, host=host, host_source="measured")
    assert report.predicted_step_s == pytest.approx(21.75)
    assert "host (measured): 500.0 ms between forward and backward" in report.to_table()
    fused = Plan(3, ((0, 2), (2, 3)), ((0, 2), (2, 3)), fused_last=True)
    assert predict(fused, costs, 2, 2, stage_overhead_s=0.0, recompute=False, host=host).host_s == pytest.approx(0.25)


def test_host_estimate_before_measurement_by_hand():
    costs = CostProfile([lc(1.0, 10, act=4), lc(1.0, 10, act=4000)], tokens_per_microbatch=8, dtype_bytes=4)
    work = estimate_host_work(costs, 3, fused_last=False)
    output = 4000 * 8 * 3  # bytes of the merged output: 3 microbatches of 8 tokens
    # only the last microbatch's 32,000 bytes are copied (read + write) after the forward; the loss
    # reads 24,000 fp32 elements
    assert work.between_s == pytest.approx(2 * 32_000 / HOST_COPY_BYTES_PER_SECOND + 24_000 * HOST_LOSS_SECONDS_PER_ELEMENT)
    assert estimate_host_work(costs, 3, fused_last=True) == HostWork()
    # issue 22's bar shape: 4 microbatches of 512 tokens of 6144 fp32 logits (24,576 bytes a token):
    # the last microbatch's 12.58 MB copied (read + write) at 24.5 GB/s, 1.03 ms, and the loss on
    # 12.58M elements at 5.5 ns (one thread, freed memory reused), 69.2 ms
    bar = CostProfile([lc(1.0, 10, act=4), lc(1.0, 10, act=24_576)], tokens_per_microbatch=512, dtype_bytes=4)
    assert estimate_host_work(bar, 4, fused_last=False).between_s == pytest.approx(0.07023, rel=1e-3)


@pytest.mark.timeout(60)
def test_runtime_measures_the_host_work_around_the_pipeline():
    net = sequential_lm()
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2))
    x = torch.randint(0, 384, (4, 8))
    try:
        for _ in range(2):
            logits = net(x)
            time.sleep(0.05)  # the caller's work on the outputs before backward
            logits.float().pow(2).mean().backward()
            time.sleep(0.03)  # the loop between steps
        host = runtime.planner.host
        assert runtime.planner.host_source == "measured"
        assert host.between_s >= 0.05
        assert host.outside_s >= 0.03
        report = runtime.planner.report()
        without = build_report(runtime.planner.plan, runtime.planner.moving.profile(), 2, 2,
                               recompute=runtime.planner.recompute)
        assert report.predicted_step_s >= without.predicted_step_s + 0.08
        assert "host (measured)" in report.to_table()
    finally:
        runtime.detach()


# ------------------------------------------------------------------ options and Hydra
def test_recompute_option_takes_auto_and_names_the_choices():
    assert RuntimeOptions().validate().recompute == "auto"
    with pytest.raises(OptionError, match=r"recompute='sometimes'\): use one of 'auto', 'always', 'layer', 'never'"):
        RuntimeOptions(recompute="sometimes").validate()
    assert PartitionConfig().policy == "compute"


def test_hydra_partition_compute_group():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["partition=compute"])
        default = compose("config")
    assert cfg.partition.policy == "compute" and default.partition.policy == "compute"
    assert PartitionConfig(**cfg.partition).validate() == PartitionConfig()
    assert default.strategy.recompute == "auto" and default.strategy.microbatches is None


@pytest.mark.timeout(60)
def test_defaults_give_the_same_plan_and_bit_identical_weights_whatever_the_timing():
    def train(seed: int):
        net = sequential_lm()
        runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(testing={"jitter_s": 0.002}, seed=seed))
        opt = runtime.overlap_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-2))
        g = torch.Generator().manual_seed(3)
        try:
            for _ in range(3):
                x = torch.randint(0, 384, (8, 4), generator=g)
                opt.zero_grad()
                nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten()).backward()
                opt.step()
            runtime.join()
            return runtime.planner.plan.to_text(), runtime.planner.microbatches, [p.detach().clone() for p in net.parameters()]
        finally:
            runtime.detach()

    plan_a, m_a, w_a = train(seed=1)
    plan_b, m_b, w_b = train(seed=2)  # other jitter, other timing
    assert (plan_a, m_a) == (plan_b, m_b)
    assert all(torch.equal(a, b) for a, b in zip(w_a, w_b))


def test_open_microbatch_count_is_chosen_again_for_the_first_batch():
    net = sequential_lm(3072, 128, 4)
    keeper = PlanKeeper(list(net), 2, KeeperConfig(PartitionConfig(), flops_per_second=5e10), fused_last=False)
    assert keeper.open_microbatches and keeper.microbatches in (2, 4, 8)
    # 3 samples: of 2, 4 and 8 microbatches only 2 fit
    plan = keeper.first_batch(batch_size=3, tokens=3 * 16)
    assert keeper.microbatches == 2 and not keeper.open_microbatches
    assert plan is None or plan is keeper.plan
    assert keeper.first_batch(batch_size=64, tokens=64 * 16) is None  # chosen once
    # a batch smaller than the workers: one sample per microbatch
    assert choose_microbatches(embedding_block_head(), 4, 8, lambda _, m: 1.0, most=3) == 3
    runtime = RoundPipeRuntime.attach(sequential_lm(), "cpu", 2, RuntimeOptions(step_metrics=False))
    try:
        net = runtime.module
        net(torch.randint(0, 384, (3, 5))).sum().backward()
        assert runtime.engine.options.microbatches == runtime.planner.microbatches == 2
    finally:
        runtime.detach()
