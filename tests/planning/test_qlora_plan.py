"""QLoRA in the planner: a config's ``quantization_config`` read into the plan, the Qwen3-235B-A22B QLoRA
preset (LoRA on the attention), and issue 44's verdict: it fits 256 GB of host RAM with the default
headroom at 8K-token sequences on 8x RTX 4090."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoConfig

from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.hf_shape import resolve_model_shape
from lightning_roundpipe.cost.machine import override_profile
from lightning_roundpipe.cost.quantization import nf4_bytes_per_param, packed_params_per_layer
from lightning_roundpipe.cost.transformer import MODEL_PRESETS, get_model_shape
from lightning_roundpipe.planning.advice import RunSettings, alternatives
from lightning_roundpipe.planning.capacity import DEFAULT_MEMORY_FRACTION, plan_training
from lightning_roundpipe.planning.fit import fit_problems, host_headroom_bytes, model_costs
from lightning_roundpipe.sim.__main__ import main
from roundpipe_lab.analysis.cli import main as lab_main  # the lab's studies (compare, small-steps)

GiB = 2**30
FAST = ["--hardware", "rtx4090", "--seq-len", "512", "--microbatches", "8", "--no-max-seq"]
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, num_hidden_layers=28, tie_word_embeddings=True)
TINY = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=4096, num_hidden_layers=4, tie_word_embeddings=True)  # plans in a second
BNB_NF4 = dict(quant_method="bitsandbytes", load_in_4bit=True, bnb_4bit_quant_type="nf4",
               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype="bfloat16")


def saved_config(tmp_path, name: str, quantization: dict | None, shape: dict = QWEN3_0_6B):
    folder = tmp_path / ("quantized" if quantization else "plain") / name
    fields = dict(shape, **({"quantization_config": quantization} if quantization else {}))
    AutoConfig.for_model("qwen3", **fields).save_pretrained(folder)
    return folder


def test_a_bitsandbytes_nf4_quantization_config_reads_as_an_nf4_base(tmp_path):
    shape, notes = resolve_model_shape(str(saved_config(tmp_path, "q4", BNB_NF4) / "config.json"))
    assert shape == dataclasses.replace(MODEL_PRESETS["qwen3-0.6b"], name="q4", quantization="nf4") and notes == []
    fp4 = dict(BNB_NF4, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False)
    shape, notes = resolve_model_shape(str(saved_config(tmp_path, "q4fp4", fp4)))
    assert shape.quantization == "nf4"
    assert notes == ["bitsandbytes fp4 is priced as nf4 (the same packed bytes)",
                     "block scales without double quantization (0.5625 B/param) are priced double-quantized "
                     "(0.5159 B/param)"]
    shape, notes = resolve_model_shape(str(saved_config(tmp_path, "q8", dict(quant_method="bitsandbytes",
                                                                              load_in_8bit=True))))
    assert shape.quantization is None
    assert notes == ["bitsandbytes 8-bit is not priced: the base is priced in the compute dtype"]


@pytest.mark.timeout(100)
def test_sim_plan_prices_the_configs_nf4_base_as_quantize_nf4(tmp_path, capsys):
    folder = saved_config(tmp_path, "q4", BNB_NF4, TINY)
    plain = saved_config(tmp_path, "q4", None, TINY)  # the same model unquantized, same name

    def lines(*argv):
        status = main(["plan", *argv, *FAST])
        return status, capsys.readouterr()

    status, read = lines("--model", str(folder), "--lora-rank", "8")
    assert status == 0
    assumed = [line for line in read.out.splitlines() if line.startswith("Assumed: model q4 from")]
    assert len(assumed) == 1 and assumed[0].endswith("tied embeddings, nf4 base")
    assert "q4 (0.00B parameters), LoRA rank 8 on a 4-bit NF4 base, on rtx4090" in read.out
    assert "packed nf4 base and compute-dtype copy" in read.out
    # the same answer as --quantize nf4 on the unquantized config, and --quantize none prices it unpacked
    status, flag = lines("--model", str(plain), "--lora-rank", "8", "--quantize", "nf4")
    assert status == 0 and flag.out.splitlines()[1:] == read.out.splitlines()[1:]
    status, unpacked = lines("--model", str(folder), "--lora-rank", "8", "--quantize", "none")
    assert status == 0 and "NF4" not in unpacked.out and "packed" not in unpacked.out
    status, attention = lines("--model", str(folder), "--lora-rank", "8", "--lora-targets", "attention")
    assert status == 0 and "q4 (0.00B parameters), LoRA rank 8 (q, k, v, o) on a 4-bit NF4 base, on rtx4090" in attention.out
    assert [l for l in attention.out.splitlines() if l.startswith("Assumed: model q4 from")][0].endswith(
        "tied embeddings, nf4 base, LoRA on the attention only")
    assert lab_main(["compare", "--model", str(folder), "--hardware", "rtx4090", "--gpus", "2", "--seq-len", "512"]) == 0
    assert "Assumed: model q4: compare prices the base unpacked (sim plan prices its nf4 base)\n" in capsys.readouterr().out
    status, refused = lines("--model", str(folder))
    assert status == 2 and refused.err == ("error: a packed nf4 base is frozen: give --lora-rank (QLoRA), or "
                                           "--quantize none to price the base unpacked\n")


def test_the_235b_qlora_preset_adapts_the_attention_of_a_packed_base():
    preset, base = MODEL_PRESETS["qwen3-235b-a22b-qlora"], MODEL_PRESETS["qwen3-235b-a22b"]
    assert preset == dataclasses.replace(base, quantization="nf4", lora_targets="attention")
    attention = 16 * ((4096 + 8192) + 2 * (4096 + 512) + (8192 + 4096))  # q, k, v, o at rank 16
    assert preset.lora_params_per_layer(16) == attention == 540_672
    assert preset.active_lora_params_per_layer(16) == attention
    experts = 128 * 16 * 3 * (4096 + 1536)  # every expert's gate, up and down
    assert base.lora_params_per_layer(16) == attention + experts == 35_143_680
    hw = load_hardware("rtx4090")
    costs = model_costs(preset, hw, 8192, 1, 16, quantize="nf4")
    assert costs.unique_trainable_params == 94 * attention  # 50.8M against 3.30B with every expert
    layer = costs.layers[1]
    packed = packed_params_per_layer(preset)
    # upload: the packed base, the fp32 norms and router, the bf16 adapters (Linear layers)
    norms_router = 2 * 4096 + 2 * 128 + 4096 * 128
    assert layer.weight_bytes == round(packed * nf4_bytes_per_param()) + 4 * norms_router + 2 * attention


def test_issue_44_qwen3_235b_qlora_at_8k_fits_256_gb_with_the_default_headroom():
    hw, _ = override_profile(load_hardware("rtx4090"), host_memory="256GB")
    headroom = host_headroom_bytes(hw.host_memory_bytes)
    assert headroom == int(0.1 * 256e9)  # max(10%, 8 GiB)
    costs = model_costs(get_model_shape("qwen3-235b-a22b-qlora"), hw, 8192, 1, 16, quantize="nf4")
    problems, host, gpu = fit_problems(costs, hw, DEFAULT_MEMORY_FRACTION, 8, True, "stage",
                                       host_budget_bytes=hw.host_memory_bytes - headroom)
    assert problems == []
    least, least_gpu = host, gpu
    trainable = 94 * 540_672
    # The adapters are Linear weights: under bf16-mixed uploaded bf16, fp32 leaves on the worker, their
    # microbatches summed in fp32 and the sum downloaded rounded to bf16 (cost/autocast_cast.download_dtype): 2 B.
    assert host.optimizer_state == 16 * trainable and host.gradient_downloads == 2 * trainable
    packed = packed_params_per_layer(get_model_shape("qwen3-235b-a22b"))
    unique = get_model_shape("qwen3-235b-a22b").num_params() + trainable
    assert host.compute_copy == 2 * unique - 94 * (2 * packed - round(packed * nf4_bytes_per_param()))
    assert 160 * GiB < host.total < hw.host_memory_bytes - headroom  # 166.8 GiB of 214.6 usable
    # with adapters on every expert (the plain preset) the optimizer state alone is 16 B x 3.30B = 52.9 GB
    every_expert = model_costs(get_model_shape("qwen3-235b-a22b"), hw, 8192, 1, 16, quantize="nf4")
    problems, host, gpu = fit_problems(every_expert, hw, DEFAULT_MEMORY_FRACTION, 8, True, "stage",
                                       host_budget_bytes=hw.host_memory_bytes - headroom)
    assert host.optimizer_state == 16 * 94 * 35_143_680
    # Since the bounded undo journal (4 GiB instead of 12 B x 3.30B), adapters on every expert fit too, narrowly:
    # 211.9 of 214.6 GiB in the least-memory plan (before the journal, no plan fit both memories).
    assert problems == [] and 200 * GiB < host.total < hw.host_memory_bytes - headroom
    run = RunSettings(8192, 1, 16, "nf4", 8, ("stage",), True, 1024, DEFAULT_MEMORY_FRACTION, True)
    advice = {a.option: a for a in alternatives(get_model_shape("qwen3-235b-a22b"), hw, run,
                                                hw.host_memory_bytes - headroom)}
    attention = advice["LoRA on the attention only (--lora-targets attention)"]
    assert attention.fits and attention.host_bytes == least.total and attention.gpu_bytes == least_gpu
    assert "--quantize nf4" not in " ".join(advice)  # already packed: not advised again


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_issue_44_plan_of_qwen3_235b_qlora_at_8k_on_256_gb():
    hw, _ = override_profile(load_hardware("rtx4090"), host_memory="256GB")
    report = plan_training("qwen3-235b-a22b-qlora", hw, 8192, lora_rank=16, quantize="nf4", find_max_seq_len=False)
    assert report.fits and report.host.total < report.host_budget_bytes
    assert report.choice.result.tokens_per_s > 0
