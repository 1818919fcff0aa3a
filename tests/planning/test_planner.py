"""Planner and command line of the simulator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_roundpipe.cost.device_overheads import extra_attention_backward_bytes_per_token
from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.memory import host_bytes
from lightning_roundpipe.cost.transformer import get_model_shape, preset_costs
from lightning_roundpipe.planning.capacity import plan_training
from lightning_roundpipe.sim.__main__ import main
from roundpipe_lab.analysis.cli import main as lab_main  # the lab's studies (compare, small-steps)
from roundpipe_lab.analysis.compare import compare_schedules, paper_table
from lightning_roundpipe.planning.capacity import SEQ_QUANTUM, longest_seq_len
from lightning_roundpipe.planning.fit import fit_problems

GiB = 2**30


def test_host_memory_is_18_bytes_per_parameter_for_full_fine_tuning():
    hw = load_hardware("rtx4090")
    costs = preset_costs("qwen3-8b", hw, 1024)
    host = host_bytes(costs)
    params = get_model_shape("qwen3-8b").num_params()
    assert host.optimizer_state == 16 * params and host.compute_copy == 2 * params
    lora = host_bytes(preset_costs("qwen3-8b", hw, 1024, lora_rank=16))
    assert lora.compute_copy > host.compute_copy  # base plus adapters in bf16
    assert lora.optimizer_state < host.optimizer_state / 100  # only the adapters have fp32 state


def test_planner_says_does_not_fit_when_the_host_is_too_small():
    # 512 GiB host (the rtx3090 profile's) with 80 GB GPUs: the 24 GB cards no longer hold Qwen3-32B's last layer
    # (14.1 GiB) since the GPU budget is the runtime's two-pool one (12.1 GiB), so they fail on the GPU too
    report = plan_training("qwen3-32b", load_hardware("a100").replace(host_memory_bytes=512 * GiB), 4096,
                           find_max_seq_len=False)
    assert not report.fits and report.choice is None
    assert report.host.total > report.host_budget_bytes
    text = report.to_text()
    assert "Verdict: does not fit (host memory)" in text and "host memory: needs at least" in text
    assert "  - LoRA rank 16 (--lora-rank 16): host " in text  # listed under "Would fit with"


def test_planner_says_does_not_fit_when_one_layer_exceeds_the_gpu():
    report = plan_training("qwen3-0.6b", "rtx4090", 524288, find_max_seq_len=False)  # past the chunked loss's longest
    assert not report.fits
    assert any("even with one layer per stage" in r for r in report.reasons)
    assert report.min_gpu_bytes > report.gpu_budget_bytes


def test_planner_recommends_a_plan_that_fits_and_the_longest_sequence():
    report = plan_training("qwen3-0.6b", "rtx4090", 1024, microbatches=8)
    assert report.fits and report.reasons == []
    choice = report.choice
    assert choice.microbatches == 8 and choice.plan.fused_last
    choice.plan.validate()
    assert choice.gpu_bytes <= report.gpu_budget_bytes
    assert choice.result.max_peak_gpu_bytes <= choice.gpu_bytes
    assert choice.result.tokens_per_s > 0 and choice.result.tokens_per_step == 8 * 1024
    longest = report.max_seq_len
    assert longest is not None and longest >= 1024 and longest % SEQ_QUANTUM == 0
    # It is the longest: one quantum more does not fit.
    hw = load_hardware("rtx4090")
    more = preset_costs("qwen3-0.6b", hw, longest + SEQ_QUANTUM, loss_chunk_tokens=report.loss_chunk_tokens)
    for layer in more.layers[more.decoder_layers[0]:more.decoder_layers[1]]:  # the planner's GPU-side backward peak
        layer.backward_transient_bytes_per_token += extra_attention_backward_bytes_per_token(
            get_model_shape("qwen3-0.6b"), layer.backward_transient_bytes_per_token)
    assert fit_problems(more, hw, report.memory_fraction, 8, True, report.max_seq_recompute,
                        host_budget_bytes=report.host_budget_bytes)[0]
    assert report.max_seq_choice is not None and report.max_seq_choice.result.tokens_per_s > 0
    text = report.to_text()
    assert "Verdict: fits" in text and "Recommended: 8 microbatches" in text and choice.plan.to_text() in text
    assert f"Longest sequence that fits: {longest} tokens" in text


def test_a_chunked_loss_allows_longer_sequences():
    plain = longest_seq_len("qwen3-0.6b", "rtx4090", microbatches=8, loss_chunk_tokens=None)  # full logits
    chunked = longest_seq_len("qwen3-0.6b", "rtx4090", microbatches=8, loss_chunk_tokens=1024)
    assert chunked > plain


def test_compare_schedules_reports_every_schedule():
    table = compare_schedules("qwen3-0.6b", "rtx4090", 1024, microbatches=8)
    assert list(table.results) == ["roundpipe", "gpipe", "1f1b", "interleaved"]
    assert all(r.fits and r.tokens_per_s > 0 for r in table.results.values())
    assert table.speedup() == pytest.approx(table.results["roundpipe"].tokens_per_s / table.best_bound().tokens_per_s)
    md = table.to_markdown()
    assert md.count("\n| ") == 5 and "| interleaved |" in md
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert {line.replace("\\|", "").count("|") for line in rows} == {7}  # plan text's pipes are escaped


def test_cli_plan_fits_and_does_not_fit(capsys):
    assert main(["plan", "--model", "qwen3-0.6b", "--hardware", "rtx4090", "--seq-len", "1024",
                 "--microbatches", "8", "--no-max-seq"]) == 0
    out = capsys.readouterr().out
    assert "Verdict: fits" in out and "tokens/s" in out and "| fused" in out
    assert main(["plan", "--model", "qwen3-32b", "--hardware", "rtx3090", "--no-max-seq"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert main(["plan", "--model", "gpt-5", "--hardware", "rtx4090"]) == 2
    assert "unknown model preset 'gpt-5'" in capsys.readouterr().err


def test_cli_paper_prints_a_markdown_table(capsys):
    assert lab_main(["small-steps", "--models", "qwen3-0.6b", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| model "))
    assert [c.strip() for c in header.split("|")[1:6]] == ["model", "RoundPipe", "GPipe+offload", "1F1B+offload",
                                                          "interleaved+offload"]  # rich pads the cells
    row = next(line for line in out.splitlines() if line.startswith("| Qwen3-0.6B"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[-1] == "1.48-2.16x" and sum(c.endswith("x") for c in cells) >= 3


@pytest.mark.slow  # a fresh interpreter (about 6 s); test_doc_figures runs `python -m lightning_roundpipe.sim plan` by default
def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "lightning_roundpipe.plan", "--model", "qwen3-0.6b",
                           "--hardware", "cpu2", "--seq-len", "256", "--microbatches", "2", "--no-max-seq"],
                          capture_output=True, text=True, timeout=110,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})  # this checkout
    assert proc.returncode in (0, 1), proc.stderr
    assert "Verdict:" in proc.stdout and "cpu2" in proc.stdout


def test_paper_table_function_matches_the_cli_format():
    text = paper_table("rtx4090", ("qwen3-0.6b",), 1024, 8)
    assert "8x rtx4090, 1024-token sequences, 8 microbatches" in text
