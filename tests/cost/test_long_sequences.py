"""Long sequences in the memory model and the planner: layer-grain recompute and the chunked loss."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_roundpipe.adapters.chunked_loss import DEFAULT_LOSS_CHUNK_TOKENS, chunked_lm_head_loss, plain_lm_head_loss
from lightning_roundpipe.cost.memory import layer_grain_graph, roundpipe_gpu_bytes, stage_activation_bytes
from lightning_roundpipe.cost.profile import CostProfile, LayerCost
from lightning_roundpipe.cost.view import CostView
from lightning_roundpipe.schedule.plan import Plan
from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.transformer import preset_costs
from lightning_roundpipe.planning.capacity import plan_training
from lightning_roundpipe.cost.device_overheads import TWO_POOL_SHARE, two_pool_budget_bytes
from lightning_roundpipe.cost.hardware import HardwareProfile
from lightning_roundpipe.planning.capacity import fitting_recompute, least_memory_plans


def hand_costs(layers=4):
    """Per layer: 8 weight and 8 gradient bytes, 100 graph bytes and 10 output bytes per token; 10 tokens, fp32."""
    cost = lambda: LayerCost(1e-3, 1e-3, 2e-3, 8, 8, 10, params=2, trainable_params=2,  # noqa: E731
                             graph_bytes_per_token=100)
    return CostProfile([cost() for _ in range(layers)], tokens_per_microbatch=10, dtype_bytes=4, input_bytes_per_token=8)


TWO_LAYER_BACKWARD = Plan(4, ((0, 1), (1, 2), (2, 3), (3, 4)), ((0, 2), (2, 4)))


def test_layer_grain_working_set_by_hand():
    view = CostView(hand_costs())
    b02, b24 = TWO_LAYER_BACKWARD.backward_stages()
    # stage grain: both layers' graphs (2 x 100 B x 10 tokens); layer grain: one layer's graph + layer 1's input
    assert stage_activation_bytes(TWO_LAYER_BACKWARD, view, b02) == (2000, 80 + 100, 0)
    assert stage_activation_bytes(TWO_LAYER_BACKWARD, view, b02, "layer") == (1000 + 100, 80 + 100, 0)
    # b24 also keeps the copy of the input it differentiates (its output gradient, 100 B)
    assert stage_activation_bytes(TWO_LAYER_BACKWARD, view, b24) == (2000 + 100, 100 + 100, 100)
    assert stage_activation_bytes(TWO_LAYER_BACKWARD, view, b24, "layer") == (1100 + 100, 100 + 100, 100)
    assert layer_grain_graph(view, 0, 4) == 1000 + 3 * 100
    f0 = TWO_LAYER_BACKWARD.forward_stages()[0]
    assert stage_activation_bytes(TWO_LAYER_BACKWARD, view, f0, "layer") == stage_activation_bytes(TWO_LAYER_BACKWARD, view, f0)
    # one worker, link unknown: the peak is b24's: its weights and gradients (32 B) with the next
    # stage's weights prefetched (16 B), its working set, its inputs (200 B), the next microbatch's
    # inputs uploaded ahead (200 B) and the previous microbatch's output gradient still going home (100 B)
    assert roundpipe_gpu_bytes(TWO_LAYER_BACKWARD, hand_costs(), 1) == [48 + 2100 + 200 + 200 + 100]
    assert roundpipe_gpu_bytes(TWO_LAYER_BACKWARD, hand_costs(), 1, recompute="layer") == [48 + 1200 + 200 + 200 + 100]
    with pytest.raises(ValueError, match="recompute grain must be one of"):
        stage_activation_bytes(TWO_LAYER_BACKWARD, view, b02, "layers")


def test_simulator_times_and_holds_layer_grain_by_hand():
    from lightning_roundpipe.sim import simulate_roundpipe
    from lightning_roundpipe.sim.simulate import SimConfig

    hw = HardwareProfile("hand", 1, 1.0, 10**6, 1e15, 10**9, 1e15)  # one worker, transfers and optimizer ~free
    results = {}
    for grain in (False, True):
        r = simulate_roundpipe(TWO_LAYER_BACKWARD, hand_costs(), hw, 2, config=SimConfig(steps=2, layer_recompute=grain))
        computes = {(x.kind, x.stage, round(x.end - x.start, 9)) for x in r.timeline if x.queue == "compute"}
        results[grain] = (r.step_s, r.max_peak_gpu_bytes, computes)
    # stage grain: a backward microbatch is recompute + backward of 2 layers (2 x 3 ms); layer grain adds the
    # forward of the stage's first layer (1 ms), run without grad to keep the second layer's input
    assert {c for c in results[False][2] if c[0] == "backward"} == {("backward", "B0", 0.006), ("backward", "B1", 0.006)}
    assert {c for c in results[True][2] if c[0] == "backward"} == {("backward", "B0", 0.007), ("backward", "B1", 0.007)}
    # one step: 4 forward stages x 2 microbatches x 1 ms, then 2 backward stages x 2 microbatches
    assert results[False][0] == pytest.approx(8e-3 + 4 * 6e-3, abs=1e-9)
    assert results[True][0] == pytest.approx(8e-3 + 4 * 7e-3, abs=1e-9)
    # the backward's working set: 2000 B of graph at stage grain, 1000 + 100 B at layer grain
    assert results[False][1] - results[True][1] == 2000 - 1100


def test_least_memory_plans_keep_a_fused_last_stage():
    plans = least_memory_plans(6, fused_last=True)
    assert [p.backward for p in plans] == [tuple((i, i + 1) for i in range(6)),
                                           ((0, 2), (2, 4), (4, 5), (5, 6)),
                                           ((0, 4), (4, 5), (5, 6)),
                                           ((0, 5), (5, 6))]
    assert all(p.forward == tuple((i, i + 1) for i in range(6)) for p in plans)


def _hardware(gpu_bytes, host_bytes):
    return HardwareProfile("hand", 1, 1.0, gpu_bytes, 1e9, host_bytes, 1e9)


def _gpu_for(budget):
    """The smallest GPU whose planning budget (``TWO_POOL_SHARE`` of it at memory_fraction 1) is ``budget`` bytes."""
    gpu = math.ceil(budget / TWO_POOL_SHARE)
    while two_pool_budget_bytes(gpu) < budget:
        gpu += 1
    while two_pool_budget_bytes(gpu - 1) >= budget:
        gpu -= 1
    return gpu


def test_planner_picks_layer_grain_when_stage_grain_does_not_fit():
    costs = hand_costs()
    # host: 16 B of fp32 state, 4 B compute copy, 4 B gradient buffer and 12 B of undo before-images per
    # parameter (8): 288 B, plus the saved stage inputs (100 B each): one layer per stage saves 3 (588 B),
    # 2-layer backward stages 1 (388 B)
    # GPUs sized by _gpu_for: the planner budgets TWO_POOL_SHARE of a GPU (two allocator pools), so a budget
    # of 2000 B is a 3500 B GPU (these were GPUs of the budgets themselves before that rule)
    hw = _hardware(gpu_bytes=_gpu_for(2000), host_bytes=496)
    # finest plan: host too small; 2-layer backward: 2648 B at stage grain, 1748 B at layer grain (the
    # 900 B of one layer's graph less its input: test_layer_grain_working_set_by_hand); 4-layer: 4532 / 1832
    assert fitting_recompute(costs, hw, 1, memory_fraction=1.0, fused_last=False) == "layer"
    assert fitting_recompute(costs, _hardware(_gpu_for(2648), 496), 1, memory_fraction=1.0, fused_last=False) == "stage"
    assert fitting_recompute(costs, _hardware(_gpu_for(1748) - 1, 496), 1, memory_fraction=1.0, fused_last=False) is None
    assert fitting_recompute(costs, _hardware(_gpu_for(1632), 588), 1, memory_fraction=1.0, fused_last=False) == "stage"  # finest
    assert fitting_recompute(costs, _hardware(_gpu_for(1632), 587), 1, memory_fraction=1.0, fused_last=False) is None  # undo priced


@pytest.mark.timeout(120)
def test_plan_training_chooses_layer_grain_for_a_host_bound_long_sequence():
    import dataclasses

    # Qwen3-1.7B on 8 GPUs of 35 GiB with a 64 GiB host: at 64K tokens the host cannot keep one input per
    # layer and microbatch, and backward stages of 2 layers need too much worker memory at stage grain.
    # (16 GiB GPUs until bf16-mixed held trainable weights as fp32 leaves with fp32 gradients,
    # cost/autocast_cast.py: 16 and 18 GiB no longer fit at all.)
    # (GPUs of 35 GiB = 20 x 7/4 since the planner budgets TWO_POOL_SHARE of the usable memory: two allocator pools.)
    hw = dataclasses.replace(load_hardware("rtx4090"), gpu_memory_bytes=35 * 2**30, host_memory_bytes=64 * 2**30)
    # The host is sized to the state here, so no headroom is kept (tests/planning/test_host_truth.py tests it).
    report = plan_training("qwen3-1.7b", hw, 65536, microbatches=8, find_max_seq_len=False, host_headroom_bytes=0)
    assert report.fits and report.recompute == "layer" and report.choice is not None
    plan = report.choice.plan
    assert max(s.end - s.start for s in plan.dispatched_backward_stages()) >= 2
    costs = preset_costs("qwen3-1.7b", hw, 65536, loss_chunk_tokens=1024)
    assert report.choice.gpu_bytes == max(roundpipe_gpu_bytes(plan, costs, 8, recompute="layer")) <= report.gpu_budget_bytes
    assert max(roundpipe_gpu_bytes(plan, costs, 8)) > report.gpu_budget_bytes  # this plan at stage grain does not fit
    assert report.choice.result.max_peak_gpu_bytes <= report.choice.gpu_bytes  # the simulator holds layer grain too
    assert report.host.total <= hw.host_memory_bytes
    assert "Recompute: layer grain (stage grain does not fit" in report.to_text()
    stage = plan_training("qwen3-1.7b", hw, 65536, microbatches=8, find_max_seq_len=False, recompute="stage",
                          host_headroom_bytes=0)
    assert not stage.fits and stage.recompute == "stage"
    assert plan_training("qwen3-1.7b", hw, 16384, microbatches=8, find_max_seq_len=False,
                         host_headroom_bytes=0).recompute == "stage"


# ------------------------------------------------------------------ the chunked loss at long sequences
def test_the_planner_costs_the_engines_loss_chunk():
    from lightning_roundpipe.adapters.hf_layers import CausalLMPostfix
    import inspect

    assert inspect.signature(CausalLMPostfix).parameters["loss_chunk_size"].default == DEFAULT_LOSS_CHUNK_TOKENS
    hw = load_hardware("rtx4090")
    report = plan_training("qwen3-1.7b", hw, 16384, microbatches=8, find_max_seq_len=False)
    assert report.loss_chunk_tokens == DEFAULT_LOSS_CHUNK_TOKENS and "1024 rows of logits" in report.to_text()
    head = preset_costs("qwen3-1.7b", hw, 16384, loss_chunk_tokens=1024).layers[-1]
    # per token of the sequence: the final RMSNorm's kept tensors (fp32 upcast, bf16 normalised input, fp32
    # reciprocal RMS), the norm's output and the hidden-state gradient (bf16), one chunk's logits (fp32 and
    # bf16) and [chunk, hidden] product spread over the sequence, and the fp32 [vocab, hidden] accumulator
    norm = 2048 * 4 + 2048 * 2 + 4
    chunk = 1024 / 16384 * (151936 * 4 + 151936 * 2 + 2048 * 2)
    assert head.graph_bytes_per_token == int(norm + 2 * 2048 * 2 + chunk + 151936 * 2048 * 4 / 16384)


def _peak_bytes(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    held = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        held += nbytes
        peak = max(peak, held)
    return out, peak


@pytest.mark.timeout(60)
def test_chunked_loss_memory_stays_bounded_at_16k_and_32k_tokens():
    h, vocab, chunk = 16, 512, 1024
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, h, generator=g, requires_grad=True)
    peaks = {}
    for n in (16384, 32768):
        hidden = torch.randn(n, h, generator=g, requires_grad=True)
        labels = torch.randint(0, vocab, (n,), generator=g)
        seen = []
        loss, peaks[n] = _peak_bytes(lambda: chunked_lm_head_loss(hidden, weight, labels, chunk,
                                                                  on_logits_chunk=lambda x: seen.append(x.shape)))
        assert seen == [(chunk, vocab)] * (n // chunk)
        # the memory model's head term: hidden in and its gradient, one chunk's logits in two fp32 copies (+ fp32 input)
        model = 2 * h * 4 * n + vocab * (4 + 2 * 4) * chunk
        assert peaks[n] <= model + vocab * h * 4 * 2  # + the fp32 weight-gradient accumulator and its copy
        ref = plain_lm_head_loss(hidden, weight, labels)
        assert torch.allclose(loss, ref, rtol=1e-5)
    # twice the tokens adds only the [n, h] gradient of the hidden states, not [n, vocab] logits
    assert peaks[32768] - peaks[16384] <= 16384 * h * 4 + 4096
    _, plain = _peak_bytes(lambda: plain_lm_head_loss(hidden, weight, labels))
    assert plain >= 32768 * vocab * 4  # the full logits


def test_chunked_loss_keeps_no_weight_gradient_buffer_for_a_frozen_head():
    h, vocab, n = 16, 4096, 2048
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, h, generator=g)  # frozen (LoRA)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=g)
    loss, frozen = _peak_bytes(lambda: chunked_lm_head_loss(hidden, weight, labels, 256))
    loss.backward()
    hidden_ref = hidden.detach().clone().requires_grad_(True)
    plain_lm_head_loss(hidden_ref, weight, labels).backward()
    assert ((hidden.grad - hidden_ref.grad).norm() / hidden_ref.grad.norm()).item() <= 1e-5
    _, trained = _peak_bytes(lambda: chunked_lm_head_loss(hidden.detach().requires_grad_(True),
                                                           weight.clone().requires_grad_(True), labels, 256))
    assert trained - frozen >= vocab * h * 4  # the fp32 [vocab, h] accumulator only the trainable head needs


# ------------------------------------------------------------------ the figure scripts
@pytest.mark.timeout(60)
def test_layer_recompute_memory_script_measures_the_saving():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2]))
    from benchmarks.validation.layer_recompute_memory import graph_bytes_per_layer, measure

    stage = measure("always", tokens=1024, width=32, layers=6)
    layer = measure("layer", tokens=1024, width=32, layers=6)
    graph = graph_bytes_per_layer(32, 1024)
    assert stage >= 6 * graph > layer  # stage grain holds every block's graph, layer grain fewer than all
    assert stage / layer >= 2.5


@pytest.mark.timeout(60)
def test_longest_sequences_script_names_what_binds():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2]))
    from benchmarks.figures.longest_sequences import markdown, what_binds

    assert what_binds("qwen3-1.7b", load_hardware("rtx4090"), 262144, None, "stage") == "GPU"
    # With the default host headroom (10% of 1 TiB kept free) Qwen3-32B's full fine-tuning at 131,072 tokens
    # binds both: the GPU (a stage holds its trainable weights as fp32 leaves with fp32 gradients) and the
    # host (its state, 22.5 B/parameter with the undo journal, plus the finest plan's saved stage inputs).
    # "host, GPU" while the undo copy was 12 B/parameter (32 in all, 976 GiB: the state alone overfilled it).
    assert what_binds("qwen3-32b", load_hardware("a100"), 131072, None, "stage") == "GPU, host"
    row = {"hardware": "rtx4090", "model": "qwen3-1.7b", "mode": "full", "stage": 512, "stage_binds": "GPU",
           "layer": None, "layer_binds": "host"}
    assert markdown([row], False).splitlines()[-1] == "| rtx4090 | qwen3-1.7b | full | 512 | GPU | none | host |"
