"""Issue 44 item 3: the planner's answer about host memory (headroom, the RAM it assumed and from where,
one needed figure, every reason, advice with figures, pinned bytes and memlock), NF4 pricing, and the
docs' bytes-per-parameter table generated from the same memory model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_roundpipe.planning import cli
from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.machine import DetectedMachine
from lightning_roundpipe.cost.memory import (DEFAULT_UNDO_JOURNAL_BYTES, DOWNLOAD_POOL_CAP_BYTES,
                                             FP32_STATE_BYTES_PER_TRAINABLE, UNDO_BYTES_PER_TRAINABLE, host_bytes,
                                             memlock_kib)
from lightning_roundpipe.cost.quantization import nf4_bytes_per_param, packed_params_per_layer
from lightning_roundpipe.cost.transformer import get_model_shape
from lightning_roundpipe.planning.bytes_per_param import bytes_per_param_rows, bytes_per_param_table
from lightning_roundpipe.planning.capacity import plan_training
from lightning_roundpipe.planning.fit import fit_problems, host_headroom_bytes, least_memory_plans, model_costs

GiB = 2**30
REPO = Path(__file__).resolve().parents[2]
ISSUE_COMMAND = ["--model", "llama-3.1-8b", "--hardware", "rtx4090", "--host-memory", "192GB", "--no-max-seq"]
# The issue's command fits since bf16 uploads' gradients are downloaded in bf16 (item 4); these answers
# that do not fit are read on 176 GB instead (the same model and plan, less RAM).
TIGHT_COMMAND = ISSUE_COMMAND[:-2] + ["176GB", "--no-max-seq"]


def _plan_text(command: list[str], rc: int) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(command) == rc
    return out.getvalue()


@pytest.fixture(scope="module")
def llama_on_176gb() -> str:
    """What the issue's command prints on 176 GB (the run does not fit: no simulation, seconds)."""
    return _plan_text(TIGHT_COMMAND, 1)


@pytest.mark.timeout(120)
def test_the_issue_command_fits_full_fine_tuning_of_llama_8b_in_192gb():
    out = _plan_text(ISSUE_COMMAND, 0)
    assert "Verdict: fits" in out
    # 168.8 GiB needed (does not fit) until the gradients of bf16 uploads were downloaded in bf16
    # (gradient download buffers 29.9 -> 15.9 GiB; the plan it picks now saves 17 stage inputs, 4.5 GiB)
    assert "Host memory: 159.1 GiB needed of 160.9 GiB usable" in out
    assert "gradient download buffers 15.9" in out


def _figure(pattern: str, text: str) -> float:
    return float(re.search(pattern, text, re.M).group(1))


def test_headroom_default_is_ten_percent_or_eight_gib_and_can_be_set():
    assert host_headroom_bytes(1000 * GiB) == 100 * GiB
    assert host_headroom_bytes(40 * GiB) == 8 * GiB  # the floor
    assert host_headroom_bytes(6 * GiB) == 6 * GiB  # never more than the RAM
    assert host_headroom_bytes(1000 * GiB, 0) == 0 and host_headroom_bytes(1000 * GiB, 3 * GiB) == 3 * GiB
    with pytest.raises(ValueError, match="must not be negative"):
        host_headroom_bytes(GiB, -1)
    assert cli.headroom_bytes("15%", 200 * GiB) == 30 * GiB and cli.headroom_bytes("16", 0) == 16 * GiB


@pytest.mark.timeout(120)
def test_a_run_that_fits_the_ram_but_not_the_headroom_does_not_fit():
    shape, hw = get_model_shape("qwen3-1.7b"), load_hardware("rtx4090")
    costs = model_costs(shape, hw, 4096, 1, None)
    plans = least_memory_plans(len(costs.layers), True)
    finest, least = (host_bytes(costs, plans[i], 8).total for i in (0, -1))
    tight = hw.replace(host_memory_bytes=finest + GiB)  # one layer per stage fits the RAM with 1 GiB to spare
    assert not fit_problems(costs, tight, 0.9, 8, True, host_budget_bytes=tight.host_memory_bytes)[0]
    assert finest - least < 7 * GiB  # the 8 GiB floor of headroom leaves too little for any plan
    report = plan_training(shape, tight, 4096, microbatches=8, find_max_seq_len=False)
    assert not report.fits and report.host_headroom_bytes == 8 * GiB
    assert report.host.total == least and report.host_budget_bytes == finest - 7 * GiB
    assert report.reasons[0] == (f"host memory: needs at least {least / GiB:.1f} GiB (with one backward stage, the "
                                 f"fewest saved stage inputs) but {(finest - 7 * GiB) / GiB:.1f} GiB is usable")
    assert report.advice and any(a.option == "optimizer_undo=False" and a.fits for a in report.advice)


@pytest.mark.timeout(120)
def test_the_issue_command_states_the_ram_its_source_and_one_needed_figure(llama_on_176gb):
    out = llama_on_176gb
    ram, headroom = 176e9, int(0.1 * 176e9)
    assert (f"Host RAM assumed: {ram / GiB:.1f} GiB, from --host-memory 176GB; {headroom / GiB:.1f} GiB kept free "
            f"for the OS and the data pipeline (default: 10% of RAM, at least 8 GiB; --host-headroom sets it): "
            f"{(int(ram) - headroom) / GiB:.1f} GiB usable for training") in out
    assert "Verdict: does not fit (host memory)" in out
    host_lines = [line for line in out.splitlines() if line.startswith("Host memory:")]
    assert len(host_lines) == 1
    needed = _figure(r"^Host memory: at least ([0-9.]+) GiB needed", out)
    # every host figure stated as needed is that one (the issue saw 248.1 and 239.6 in one answer)
    assert {float(x) for x in re.findall(r"needs at least ([0-9.]+) GiB", out)} == {needed}
    costs = model_costs(get_model_shape("llama-3.1-8b"), load_hardware("rtx4090"), 4096, 1, None)
    least = host_bytes(costs, least_memory_plans(len(costs.layers), True)[-1], 8)
    # On 192 GB: 239.6 until the undo copy became a bounded journal (4 GiB instead of 12 B/param) and the
    # fused call's gradient downloads were priced in fp32 (4 B/param instead of 2), then 168.8 until the
    # gradients of bf16 uploads were downloaded in bf16 (2 B/param for Linear weights, 15.0 GiB less)
    assert needed == round(least.total / GiB, 1) == 154.8


@pytest.mark.timeout(120)
def test_the_advice_lists_every_option_that_fits_with_its_figures(llama_on_176gb):
    out = llama_on_176gb
    fitting, not_fitting = out.split("Would fit with")[1].split("Would not fit")
    costs = model_costs(get_model_shape("llama-3.1-8b"), load_hardware("rtx4090"), 4096, 1, None)
    no_undo = host_bytes(costs, least_memory_plans(len(costs.layers), True)[-1], 8, undo=False)
    assert no_undo.total == host_bytes(costs, least_memory_plans(len(costs.layers), True)[-1], 8).total - 4 * GiB
    # GPU 5.4 GiB until bf16-mixed's weights were priced as held (fp32 leaves, fp32 embedding and gradients);
    # it fitted until the undo's 12 B/param became a 4 GiB journal and gradient downloads were priced in fp32
    assert f"  - optimizer_undo=False: host {no_undo.total / GiB:.1f} GiB, GPU 9.1 GiB per worker" in not_fitting
    assert "  - LoRA rank 16 (--lora-rank 16): host " in fitting
    assert "  - a 4-bit NF4 base with LoRA rank 16 (--quantize nf4 --lora-rank 16): host " in fitting
    qlora = _figure(r"--quantize nf4 --lora-rank 16\): host ([0-9.]+) GiB", fitting)
    lora = _figure(r"--lora-rank 16\): host ([0-9.]+) GiB", fitting)
    assert qlora < lora < 147.5
    # fewer microbatches alone does not fit, and says so with its figure
    assert re.search(r"Would not fit with any one of these alone.*\n(?:  - .*\n)*  - 1 microbatch per step \(--microbatches 1\): "
                     r"host 154\.[0-9] GiB", out)  # 168.x on 192 GB before bf16 downloads


def test_the_default_source_is_the_profile_and_detect_says_so(monkeypatch, capsys):
    hw = load_hardware("rtx4090")
    args = cli.build_parser().parse_args(["--model", "qwen3-8b", "--hardware", "rtx4090"])
    assert cli.host_memory_source(args, hw) == "the rtx4090 profile, not your machine: pass --host-memory or --detect"
    args = cli.build_parser().parse_args(["--model", "qwen3-8b", "--detect"])
    assert cli.host_memory_source(args, hw).startswith("--detect")
    monkeypatch.setattr(cli, "detect_machine", lambda: DetectedMachine(0, None, None, 64 * GiB, 4))
    # Qwen3-32B full fine-tuning on 64 GiB: does not fit, so no simulation runs
    assert cli.main(["--model", "qwen3-32b", "--detect", "--no-max-seq", "--microbatches", "8"]) == 1
    out = capsys.readouterr().out
    assert "Host RAM assumed: 64.0 GiB, from --detect (this machine's RAM" in out
    assert "8.0 GiB kept free" in out and "56.0 GiB usable for training" in out


@pytest.mark.timeout(120)
def test_every_reason_is_named_host_and_gpu(capsys):
    # LoRA at 131,072 tokens on 256 GiB: one layer per stage overflows the GPUs and, with its saved
    # stage inputs, the host too; coarser backward stages would keep less on the host but need more GPU.
    assert cli.main(["--model", "llama-3.1-8b", "--hardware", "rtx4090", "--host-memory", "256",
                     "--lora-rank", "16", "--seq-len", "131072", "--no-max-seq"]) == 1
    out = capsys.readouterr().out
    assert "Verdict: does not fit (host memory, GPU memory)" in out
    reasons = [line[4:] for line in out.splitlines() if line.startswith(("  - host memory:", "  - GPU memory:"))]
    assert [r.split(":")[0] for r in reasons] == ["GPU memory", "host memory"]
    costs = model_costs(get_model_shape("llama-3.1-8b"), load_hardware("rtx4090"), 131072, 1, 16)
    finest = host_bytes(costs, least_memory_plans(len(costs.layers), True)[0], 8)
    assert (f"saves 33 stage inputs x 8 microbatches ({finest.saved_activations / GiB:.1f} GiB) and needs "
            f"{finest.total / GiB:.1f} GiB of 230.4 GiB usable") in reasons[1]
    # 72,192 until bf16-mixed's weights were priced as held (the frozen embedding uploaded in fp32); 68,608 until
    # the planner budgeted the runtime's two-pool share of the GPU (TWO_POOL_SHARE, 4/7)
    assert "sequences of 35328 tokens (--seq-len 35328)" in out.split("Would fit with")[1]


def test_a_run_that_no_single_plan_fits_names_both_memories():
    shape, hw = get_model_shape("llama-3.1-8b"), load_hardware("rtx4090")
    costs = model_costs(shape, hw, 131072, 1, 16)
    plans = least_memory_plans(len(costs.layers), True)
    finest, least = (host_bytes(costs, plans[i], 8).total for i in (0, -1))
    # one layer per stage fits a worker, coarser cuts do not (84 GiB = 48 x 7/4: the planner budgets TWO_POOL_SHARE)
    big_gpus = hw.replace(gpu_memory_bytes=84 * GiB)
    budget = (finest + least) // 2
    problems = fit_problems(costs, big_gpus, 0.9, 8, True, host_budget_bytes=budget)[0]
    assert len(problems) == 1 and problems[0].startswith(
        f"no plan fits both memories: one layer per stage keeps {finest / GiB:.1f} GiB on the host")
    report = plan_training(shape, big_gpus.replace(host_memory_bytes=budget), 131072, lora_rank=16, microbatches=8,
                           find_max_seq_len=False, host_headroom_bytes=0, recompute="stage")  # layer grain fits
    assert report.reasons == problems
    assert "Verdict: does not fit (host and GPU memory together)" in report.to_text()
    assert any(a.option == "recompute='layer' (--recompute layer)" and a.fits for a in report.advice)


def test_pinned_bytes_and_the_memlock_limit_they_need(llama_on_176gb):
    assert memlock_kib(1) == 1 and memlock_kib(1024) == 1 and memlock_kib(1025) == 2
    costs = model_costs(get_model_shape("llama-3.1-8b"), load_hardware("rtx4090"), 4096, 1, None)
    least = host_bytes(costs, least_memory_plans(len(costs.layers), True)[-1], 8)
    line = next(l for l in llama_on_176gb.splitlines() if l.startswith("Pinned host memory:"))
    assert line.startswith(f"Pinned host memory: {least.pinned / GiB:.1f} GiB")
    assert line.endswith(f"locked-memory limit needed: ulimit -l {-(-least.pinned // 1024)} (KiB) or unlimited "
                         f"(containers: --ulimit memlock=-1)")


def test_nf4_prices_packed_projections_by_hand():
    assert nf4_bytes_per_param() == 0.5 + (1 + 4 / 256) / 64 and nf4_bytes_per_param(False) == 0.5625
    shape, hw = get_model_shape("llama-3.1-8b"), load_hardware("rtx4090")
    bf16, nf4 = model_costs(shape, hw, 1024, 1, 16), model_costs(shape, hw, 1024, 1, 16, quantize="nf4")
    packed = packed_params_per_layer(shape)
    assert packed == 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336  # q, o, k, v, gate, up, down
    layer, plain = nf4.layers[1], bf16.layers[1]
    assert plain.weight_bytes - layer.weight_bytes == round(packed * (2 - nf4_bytes_per_param()))
    assert nf4.layers[0].weight_bytes == bf16.layers[0].weight_bytes  # the embedding stays bf16
    # dequantization: packed bytes read, bf16 written, at the 4090's 1008 GB/s, once per compute
    assert layer.forward_s - plain.forward_s == pytest.approx(packed * (nf4_bytes_per_param() + 2) / 1008e9)
    # the largest projection dequantized to bf16 (the MLP's 4096 x 14336) is alive in each working set
    dequantized = -(-4096 * 14336 * 2 // 1024)
    assert layer.backward_transient_bytes_per_token - plain.backward_transient_bytes_per_token == dequantized
    assert layer.forward_transient_bytes_per_token - plain.forward_transient_bytes_per_token == dequantized
    h, h16 = host_bytes(nf4), host_bytes(bf16)
    assert h16.compute_copy - h.compute_copy == 32 * round(packed * (2 - nf4_bytes_per_param()))
    assert h.optimizer_state == h16.optimizer_state  # the adapters train as before
    with pytest.raises(ValueError, match="quantization needs LoRA"):
        model_costs(shape, hw, 1024, 1, None, quantize="nf4")


def test_bytes_per_param_rows_come_from_the_memory_model():
    rows = {name: total for name, total, _ in bytes_per_param_rows()}
    full, no_undo = rows["full fine-tuning (default: optimizer_undo=True)"], rows["full fine-tuning, optimizer_undo=False"]
    params = host_bytes(model_costs(get_model_shape("llama-3.1-8b"), load_hardware("rtx4090"), 1024, 1, None)).params
    # fp32 state 16, bf16 upload copy 2, the fused call's gradient downloads (bf16 for Linear weights, fp32
    # for the embedding and norms: 2.13; 4 before bf16 downloads, when no_undo was 22), the bounded journal
    fp32_uploads = 128256 * 4096 + (2 * 32 + 1) * 4096  # the embedding table and the norms
    assert no_undo == pytest.approx(FP32_STATE_BYTES_PER_TRAINABLE + 2 + 2 + 2 * fp32_uploads / params)  # 20.13
    assert full == pytest.approx(no_undo + DEFAULT_UNDO_JOURNAL_BYTES / params)  # 20.67 (22.53 before, 32 with the old copy)
    assert rows["QLoRA r=16 (NF4 base, `--quantize nf4`)"] < rows["LoRA r=16"] < no_undo


@pytest.mark.parametrize("page", ["docs/limitations.md", "docs/finetune.md"])
def test_the_docs_show_the_bytes_per_param_table_the_model_makes_now(page):
    text = (REPO / page).read_text()
    block = re.search(r"^<!-- figures:host-bytes-per-param -->\n(.*?)^<!-- /figures -->$", text, re.M | re.S)
    assert block is not None, f"{page} has no host-bytes-per-param block"
    assert block.group(1) == bytes_per_param_table() + "\n", f"stale: run python scripts/doc_figures.py ({page})"
    assert "about 16 bytes per parameter" not in text


def test_the_undo_journal_and_the_gradient_downloads_are_priced_as_they_are():
    from lightning_roundpipe.workers.host_buffers import DEFAULT_CAP_BYTES

    assert DOWNLOAD_POOL_CAP_BYTES == DEFAULT_CAP_BYTES
    costs = model_costs(get_model_shape("qwen3-8b"), load_hardware("rtx4090"), 1024, 1, None)
    plan = least_memory_plans(len(costs.layers), True)[0]
    trainable = host_bytes(costs).params  # full fine-tuning: every parameter trains
    unbounded = host_bytes(costs, plan, 8, journal_bytes=None)
    assert unbounded.undo_images == trainable * UNDO_BYTES_PER_TRAINABLE  # the old full copy
    assert host_bytes(costs, plan, 8).undo_images == DEFAULT_UNDO_JOURNAL_BYTES
    assert host_bytes(costs, plan, 8, journal_bytes=GiB).undo_images == GiB
    assert host_bytes(costs, plan, 8, undo=False).undo_images == 0
    # bf16-mixed downloads the gradients of bf16 uploads (Linear weights) in bf16, the others (the embedding,
    # norms) in fp32; a fused call keeps them all (4 B/param, 32.8 GB, before bf16 downloads)
    fused = host_bytes(costs, plan, 8)
    fp32_uploads = 151936 * 4096 + 36 * (2 * 4096 + 2 * 128) + 4096  # embedding, layer norms and q/k norms, final norm
    assert fused.gradient_downloads == sum(l.grad_download_bytes for l in costs.layers) == 2 * trainable + 2 * fp32_uploads
    assert sum(l.grad_bytes for l in costs.layers) == 4 * trainable  # the worker still sums in fp32
    # unfused, each stage's buffers go back to the pool once added: the pool's cap, or one stage's gradients
    unfused = least_memory_plans(len(costs.layers), False)[0]
    largest = max(sum(costs.layers[i].grad_download_bytes for i in s.layers) for s in unfused.backward_stages())
    assert host_bytes(costs, unfused, 8).gradient_downloads == max(DOWNLOAD_POOL_CAP_BYTES, largest)
