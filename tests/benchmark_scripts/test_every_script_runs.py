"""Every runnable benchmark script runs: its ``main`` on tiny arguments, in this process, printing its table.

``SMOKE`` holds the arguments and a line the output must contain; ``RUN_ELSEWHERE`` names the test file
that already runs a script's ``main`` (so it is not run twice). A new script must be added to one of them
(``test_every_runnable_script_is_smoke_tested``). Scripts that cannot run in a few seconds are marked slow,
with the reason in ``Smoke.slow``.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


@dataclass(frozen=True)
class Smoke:
    argv: tuple[str, ...]
    prints: str  # a line fragment the run must print (a table's header, a figure's name)
    slow: str = ""  # why it cannot be made fast; the test is then marked slow


SMOKE = {
    # peers
    "peers.cpu_peers": Smoke(("--quick", "--shapes", "light", "--systems", "roundpipe", "--recompute", "off",
                              "--steps", "1", "--warmup", "0", "--rounds", "1", "--max-retries", "0"),
                             "| light-head | roundpipe (2 CPU workers) | off |",
                             slow="spawns a fresh process per run, by design (its own peak RSS): 15-20 s"),
    "peers.out_of_box": Smoke(("--overhead",), "cost per microbatch of a stage:"),
    # calibration
    "calibration.compiled_layers": Smoke(("--quick", "--rounds", "1"), "forward_backward",
                                         slow="inductor compiles the layer: 20-60 s cold on 2 cores"),
    "calibration.dispatch_cost": Smoke(("--tasks", "200", "--layers", "2", "--microbatches", "2"),
                                       "tasks per compute task in a RoundPipe step (28 layers, 24 stages"),
    "calibration.host_rates": Smoke(("--mib", "8"), "adam_params_per_s:"),
    "calibration.kernel_rates": Smoke((), "achievable fp16-accumulate matmul:"),
    "calibration.lane_cost": Smoke(("--quick", "--microbatches", "4", "--rounds", "1"), "| cpu_backend |",
                                   slow="8 fake GPUs x 3 lanes with hundreds of tasks: about 6 s"),
    "calibration.launch_budget": Smoke(("--microbatches", "2", "--steps", "1", "--workers", "2"),
                                     "launches_forward_per_layer_mb", slow="fake streams over Qwen3-8B-shaped layers: about 5 s"),
    # validation
    "validation.block_stack_compiled": Smoke(("--backend", "aot_eager"), "| whole model | aot_eager |"),
    "validation.block_stack_parity": Smoke(("--cases", "1"), "| nanoGPT, tied head | sgd | 2 |"),
    "validation.emulated_gpus": Smoke(("--models", "qwen3-1.7b", "--gpus", "2", "--steps", "1",
                                       "--target-step-s", "0.2", "--launch-profiles", "rtx4090"), "| qwen3-1.7b | 2 |",
                                      slow="emulated GPUs for a real step: about 5 s"),
    "validation.layer_recompute_memory": Smoke(("--tokens", "64", "--width", "32", "--layers", "2"),
                                               "less held by the worker during the backward stage with layer grain"),
    "validation.memory_sweep": Smoke(("--quick", "--cases", "1"), "worst error of the plan's peak over 1 cases"),
    "validation.published_gpu": Smoke(("--models", "qwen3-1.7b"), "| qwen3-1.7b | RoundPipe |"),
    # figures
    "figures.block_stack_host_cost": Smoke(("--vocab", "256", "--dim", "16", "--layers", "2", "--seq", "8",
                                            "--batch", "4", "--microbatches", "2", "--repeats", "1"),
                                           "| declared chain (embedding, head on workers) |"),
    "figures.host_allocator_faults": Smoke(("--pairs", "1", "--runs", "1"), "page faults (medians of 1)",
                                           slow="a process per mode, glibc's setting cannot be put back: 12 s of CPU"),
    "figures.long_sequence_throughput": Smoke(("--lengths", "2048",), "| 2,048 | 128 | stage |"),
    "figures.longest_sequences": Smoke(("--hardware", "rtx4090", "--models", "qwen3-1.7b", "--no-paper-check"),
                                       "| rtx4090 | qwen3-1.7b | full |"),
    "figures.moe_expert_paths": Smoke(("--gpus", "8", "--imbalance", "1.0", "--break-even-steps", "0"),
                                      "gpt-oss-20b, 128 x 2048 tokens"),
    "figures.moe_grouped_experts": Smoke(("--tokens", "64", "--experts", "4", "--hidden", "16", "--intermediate", "32",
                                          "--repeats", "1"),
                                         "64 tokens, 4 experts, top-2, hidden 16, intermediate 32"),
    "figures.moe_presets": Smoke(("--models", "gpt-oss-20b"), "| GPT-OSS-20B | 20.9B |"),
    "figures.optimizer_overlap": Smoke(("--params", "2e4", "--steps", "2", "--width", "64"),
                                       "final weights bit-identical across all runs: True"),
    "figures.sdpa_cpu_memory": Smoke(("--tokens", "256",), "decoder layer, sdpa , padded: kept",
                                     slow="imports the Hugging Face stack and runs 10 cases: about 8 s of CPU"),
    "figures.step_undo_cost": Smoke(("--paired", "--journal-layers", "1", "--width", "64", "--depth", "4",
                                     "--steps", "6", "--repeats", "1"), "journal of 1 of 4 layers / off step time, median",
                                    slow="three systems on paired steps in one process: about 11 s on 2 cores"),
    "figures.scaling_plot": Smoke(("--models", "qwen3-1.7b", "--max-gpus", "2", "--out", "{tmp}/scaling.png"),
                                  "wrote {tmp}/scaling.png"),
}

# script -> the test file that runs its main() (the smoke here would repeat it)
RUN_ELSEWHERE = {
    "peers.gpu_bench": "tests/benchmark_scripts/test_benchmarks_smoke.py",
    "calibration.checkpoint_integrity": "tests/benchmark_scripts/test_checkpoint_integrity_bench.py",
    "calibration.device_rng_cost": "tests/benchmark_scripts/test_host_update_benchmarks.py",
    "calibration.early_stop_recompute": "tests/benchmark_scripts/test_benchmarks_smoke.py",
    "calibration.host_accumulate_cost": "tests/benchmark_scripts/test_harness.py",
    "calibration.host_update_rate": "tests/benchmark_scripts/test_host_update_benchmarks.py",
    "validation.gpu_session": "tests/benchmark_scripts/test_gpu_session.py",
    "validation.gpu_validate": "tests/benchmark_scripts/test_gpu_validate_smoke.py",
    "validation.sim_validation": "tests/benchmark_scripts/test_figure_scripts.py",
    "figures.own_engine_reference": "tests/lab/test_sim_paper.py",
    "figures.partition_transfer": "tests/benchmark_scripts/test_figure_scripts.py",
    "figures.qlora_plan": "tests/benchmark_scripts/test_qlora_plan_figures.py",
    "figures.quick_size_gap": "tests/benchmark_scripts/test_figure_scripts.py",
}


def runnable_scripts() -> list[str]:
    """Every script under benchmarks/<folder>/ that runs as a command (has a ``__main__`` block)."""
    return sorted(f"{p.parent.name}.{p.stem}" for p in BENCHMARKS.glob("*/*.py")
                  if 'if __name__ == "__main__":' in p.read_text())


def test_every_runnable_script_is_smoke_tested():
    assert not set(SMOKE) & set(RUN_ELSEWHERE)
    assert sorted([*SMOKE, *RUN_ELSEWHERE]) == runnable_scripts()


@pytest.mark.parametrize("script", sorted(RUN_ELSEWHERE))
def test_the_test_named_for_a_script_runs_its_main(script):
    text = (REPO / RUN_ELSEWHERE[script]).read_text()
    folder, name = script.split(".")
    calls_main = re.search(rf"\b{name}\.main\(|from benchmarks\.{folder}\.{name} import .*\bmain\b", text)
    runs_command = f'"benchmarks.{script}"' in text
    assert calls_main or runs_command, f"{RUN_ELSEWHERE[script]} does not run {script}"


def smoke_params():
    for script, smoke in sorted(SMOKE.items()):
        marks = [pytest.mark.slow, pytest.mark.timeout(600)] if smoke.slow else [pytest.mark.timeout(60)]
        yield pytest.param(script, smoke, marks=marks, id=script)


@pytest.fixture
def process_state():
    """Scripts set torch's thread count and environment variables for their runs (cpu_peers: glibc's
    malloc settings for its children); put both back for the rest of the suite."""
    threads, environ = torch.get_num_threads(), dict(os.environ)
    yield
    torch.set_num_threads(threads)
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


@pytest.mark.parametrize("script, smoke", smoke_params())
def test_the_script_runs_on_tiny_arguments(script, smoke, tmp_path, monkeypatch, capfd, process_state):
    monkeypatch.chdir(tmp_path)  # anything a script writes by default lands here
    module = importlib.import_module(f"benchmarks.{script}")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in smoke.argv]
    module.main(argv)
    out = capfd.readouterr().out  # capfd: a script's child processes print too
    assert smoke.prints.replace("{tmp}", str(tmp_path)) in out, out[-3000:]
