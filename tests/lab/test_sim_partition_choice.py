"""Which partition a simulated setup runs: the engine's FLOP estimate for its default ``compute`` policy,
and the per-worker breakdown of a simulated step (``analysis/exact_gap.step_breakdown``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from roundpipe_lab.analysis import own_engine, paper
from roundpipe_lab.analysis.exact_gap import PARTS, step_breakdown
from roundpipe_lab.analysis.own_engine import Setup, engine_estimate, simulate_setup
from roundpipe_lab.analysis.workload import PublishedRun, Workload
from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.cost.transformer import ModelShape
from lightning_roundpipe.planning.keeper import ASSUMED_TOKENS_PER_MICROBATCH


def test_the_estimate_constants_are_the_gpu_backends_own():
    from lightning_roundpipe.workers.pool import WorkerPool

    assert own_engine.ENGINE_ESTIMATE_FLOPS_PER_S == WorkerPool.assumed_flops_per_s
    assert own_engine.ENGINE_ESTIMATE_LINK_BYTES_PER_S == WorkerPool.assumed_link_bytes_per_s


def test_engine_estimate_by_hand():
    # embedding (a lookup), one decoder layer, the head; 2-byte dtype, outputs 8 / 8 / 4 elements per token
    layers = [LayerCost(1.0, 1.0, 2.0, 200, 200, 16, params=100, trainable_params=100),
              LayerCost(5.0, 5.0, 9.0, 1000, 1000, 16, params=500, trainable_params=500, active_params=300,
                        early_stop_s=1.5),
              LayerCost(3.0, 3.0, 6.0, 400, 400, 8, params=200, trainable_params=200)]
    costs = CostProfile(layers, tokens_per_microbatch=4096, dtype_bytes=2, decoder_layers=(1, 2))
    est = engine_estimate(costs)
    t, f = ASSUMED_TOKENS_PER_MICROBATCH, 1e14
    # forward = (2 x matmul params + output elements) x tokens / FLOP rate; the embedding has no matmul params,
    # an MoE layer counts its active ones
    expected = [(0 + 8) * t / f, (2 * 300 + 8) * t / f, (2 * 200 + 4) * t / f]
    assert [c.forward_s for c in est.layers] == pytest.approx(expected, rel=1e-12)
    assert [c.recompute_s for c in est.layers] == pytest.approx(expected, rel=1e-12)
    assert [c.backward_s for c in est.layers] == pytest.approx([2 * e for e in expected], rel=1e-12)
    assert [c.weight_bytes for c in est.layers] == [200, 1000, 400]
    assert [c.early_stop_s for c in est.layers] == [0.0] * 3  # the engine's estimate does not price the early stop
    assert est.tokens_per_microbatch == t and est.link_bytes_per_second == 25e9 and not est.measured
    # attention (FLOPs per token, ``cost.attention_blocks``) adds to the decoder layers only
    priced = engine_estimate(costs, attention_flops_per_token=1000.0)
    assert [c.forward_s for c in priced.layers] == pytest.approx([expected[0], (2 * 300 + 8 + 1000) * t / f, expected[2]],
                                                                 rel=1e-12)


def test_the_compute_policy_prices_attention_for_the_runs_sequences(monkeypatch):
    from lightning_roundpipe.cost.attention_blocks import attention_flops_per_token

    seen = []
    real = own_engine.engine_estimate
    monkeypatch.setattr(own_engine, "engine_estimate", lambda costs, attention=0.0: seen.append(attention) or real(costs, attention))
    assert simulate_setup(tiny_run(), load_hardware("rtx4090"), Setup(partition="compute"), optimizer_steps=2).tokens_per_s > 0
    assert seen == [attention_flops_per_token([(TINY.q_dim, None)], 256)] == [4 * 256 * 128]


TINY = ModelShape("tiny", 256, 768, 4, 2, 64, 4096, 4)


def tiny_run() -> PublishedRun:
    work = Workload(32, 4, 2, seq_len=256)
    return PublishedRun(TINY, work, replace(work, optimizer="sync"), 1.0, 1.0)


@pytest.mark.timeout(60)
def test_the_compute_policy_plans_on_the_engine_estimate(monkeypatch):
    seen = []
    real = own_engine.partition

    def spy(policy, costs, *args, **kwargs):
        seen.append((policy, costs.source, costs.tokens_per_microbatch, kwargs["link_bytes_per_second"]))
        return real(policy, costs, *args, **kwargs)

    monkeypatch.setattr(own_engine, "partition", spy)
    hw = load_hardware("rtx4090")
    assert simulate_setup(tiny_run(), hw, Setup(partition="compute"), optimizer_steps=2).tokens_per_s > 0
    assert simulate_setup(tiny_run(), hw, Setup(partition="auto"), optimizer_steps=2).tokens_per_s > 0
    assert seen[0] == ("compute", "estimate", ASSUMED_TOKENS_PER_MICROBATCH, 25e9)
    assert seen[1][0] == "auto" and seen[1][1] != "estimate" and seen[1][3] == hw.host_device_bytes_per_s


@pytest.mark.timeout(60)
def test_step_breakdown_adds_up_to_the_period():
    hw = load_hardware("rtx4090")
    for setup in (Setup(partition="auto"), replace(own_engine.our_default(hw), partition="auto", microbatches=8)):
        result = simulate_setup(tiny_run(), hw, setup, optimizer_steps=2)
        b = step_breakdown(result)
        assert list(b["parts"]) == list(PARTS)
        assert sum(b["parts"].values()) == pytest.approx(b["period"], rel=1e-9)
        assert b["max_compute"] >= b["parts"]["compute"] > 0
        assert all(v >= -1e-12 for k, v in b["parts"].items() if k != "boundary")
    # at the call barrier the boundary is layer 0's gradient home, its update, then the upload and start
    assert b["parts"]["boundary"] > 0
    assert sum(b["boundary"].values()) == pytest.approx(b["parts"]["boundary"], rel=1e-9)


def test_best_exact_tries_the_planners_partition():
    hw = load_hardware("rtx4090")
    candidates = paper.exact_candidates(hw, 2)
    assert [(c.partition, c.microbatches, c.calls) for c in candidates] == [
        ("reference", 20, 1), ("reference", 60, 1), (paper.PLANNED_PARTITION, 60, 1), (paper.PLANNED_PARTITION, 30, 2)]
    assert all(c.staleness == 0 and c.compiled_layers for c in candidates)


def test_breakdown_table_prints_every_part(monkeypatch, capsys):
    from roundpipe_lab.analysis import exact_gap

    parts = dict(zip(PARTS, (16.15, 0.53, 0.37, 0.86, 0.29)))
    monkeypatch.setattr(exact_gap, "breakdown_rows", lambda model: [
        dict(model=model, setup="best exact, planner's partition", tokens_per_s=58263.4, period=18.2, parts=parts,
             max_compute=16.17, boundary={})])
    exact_gap.main(["qwen3-1.7b"])
    lines = capsys.readouterr().out.splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0] == ["model", "setup", "tokens/s", "compute", "fill", "drain", "idle inside", "boundary",
                        "busiest worker"]
    assert cells[2] == ["qwen3-1.7b", "best exact, planner's partition", "58,263", "16.15", "0.53", "0.37", "0.86",
                        "0.29", "16.17"]
