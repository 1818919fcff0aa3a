"""``sim plan`` on the user's own model (a local config) and the user's own machine (options, --detect)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoConfig

from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.hf_shape import resolve_model_shape
from lightning_roundpipe.cost.machine import (DetectedMachine, apply_detection, link_bytes_per_s, override_profile,
                                              profile_for_gpu)
from lightning_roundpipe.cost.transformer import MODEL_PRESETS
from lightning_roundpipe.sim.__main__ import main

GiB = 2**30
FAST = ["--seq-len", "512", "--microbatches", "8", "--no-max-seq"]

# config.json fields that give each preset's shape (as the model repositories publish them)
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, num_hidden_layers=28, tie_word_embeddings=True)
LLAMA_3_1_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=128256, num_hidden_layers=32, tie_word_embeddings=False)
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, tie_word_embeddings=False)


def saved_config(tmp_path, model_type: str, fields: dict, name: str):
    folder = tmp_path / name
    AutoConfig.for_model(model_type, **fields).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("model_type, fields, preset", [("qwen3", QWEN3_0_6B, "qwen3-0.6b"),
                                                        ("llama", LLAMA_3_1_8B, "llama-3.1-8b"),
                                                        ("qwen3_moe", QWEN3_30B_A3B, "qwen3-30b-a3b")])
def test_a_saved_config_reads_as_the_preset_of_the_same_model(tmp_path, model_type, fields, preset):
    folder = saved_config(tmp_path, model_type, fields, "my-model")
    for spec in (folder, folder / "config.json"):
        shape, notes = resolve_model_shape(str(spec))
        assert shape == dataclasses.replace(MODEL_PRESETS[preset], name="my-model") and notes == []


def test_mixtral_experts_use_the_intermediate_size(tmp_path):
    folder = saved_config(tmp_path, "mixtral", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                    num_key_value_heads=2, num_hidden_layers=2, vocab_size=100,
                                                    num_local_experts=8, num_experts_per_tok=2), "mix")
    shape, _ = resolve_model_shape(str(folder / "config.json"))
    assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate, shape.head_dim) == (8, 2, 96, 16)


def test_shared_experts_are_named_as_not_modelled(tmp_path):
    folder = saved_config(tmp_path, "qwen2_moe", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=100,
                                                      num_experts=4, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=48), "q2moe")
    _, notes = resolve_model_shape(str(folder))
    assert notes == ["shared experts are not modelled (their FLOPs and bytes are left out)"]


def plan_lines(capsys, argv):
    status = main(argv)
    return status, capsys.readouterr().out.splitlines()


@pytest.mark.timeout(100)
def test_sim_plan_on_a_model_directory_and_its_config_json_matches_the_preset(tmp_path, capsys):
    folder = saved_config(tmp_path, "qwen3", QWEN3_0_6B, "my-qwen")
    status, preset = plan_lines(capsys, ["plan", "--model", "qwen3-0.6b", "--hardware", "rtx4090", *FAST])
    for spec in (folder, folder / "config.json"):
        mine_status, mine = plan_lines(capsys, ["plan", "--model", str(spec), "--hardware", "rtx4090", *FAST])
        assert mine_status == status == 0
        assert mine[0] == (f"Assumed: model my-qwen from {spec}: hidden 1024, intermediate 3072, 28 layers, 16 heads "
                           f"(8 kv) of 128, vocab 151936, tied embeddings")
        assert mine[1].startswith("my-qwen (0.60B parameters), full fine-tuning, on rtx4090")
        assert mine[2:] == preset[1:]  # same verdict, memory, plan and prediction as the preset


@pytest.mark.timeout(100)
def test_sim_plan_on_a_moe_config_json(tmp_path, capsys):
    folder = saved_config(tmp_path, "qwen3_moe", dict(QWEN3_30B_A3B, num_hidden_layers=4), "small-moe")
    status, out = plan_lines(capsys, ["plan", "--model", str(folder / "config.json"), "--hardware", "rtx4090",
                                      "--gpus", "2", *FAST])
    assert status == 0 and out[0] == "Assumed: 2 GPU(s) (profile: 8)"
    assert "128 experts (top-8) of intermediate 768" in out[1]
    params = dataclasses.replace(MODEL_PRESETS["qwen3-30b-a3b"], num_layers=4).num_params()
    assert out[2].startswith(f"small-moe ({params / 1e9:.2f}B parameters), full fine-tuning, on rtx4090 (2 x 24.0 GiB")


def test_a_hub_id_is_refused_with_the_download_command(capsys):
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--hardware", "rtx4090"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 'Qwen/Qwen3-8B' is not a model preset nor a local path, and the planner never downloads")
    assert "`hf download Qwen/Qwen3-8B config.json --local-dir ./Qwen3-8B`" in err


def test_a_directory_without_config_json_is_refused(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path), "--hardware", "rtx4090"]) == 2
    assert f"{tmp_path} has no config.json" in capsys.readouterr().err


def test_profile_overrides_replace_only_the_named_fields():
    base = load_hardware("rtx4090")
    hw, said = override_profile(base, gpus=2, gpu_memory="16", host_memory="128 GB", pcie="gen3")
    assert (hw.num_gpus, hw.gpu_memory_bytes, hw.host_memory_bytes, hw.host_device_bytes_per_s) == (
        2, 16 * GiB, 128 * 10**9, 12.5e9)
    assert dataclasses.replace(hw, num_gpus=8, gpu_memory_bytes=base.gpu_memory_bytes,
                               host_memory_bytes=base.host_memory_bytes, host_device_bytes_per_s=25e9) == base
    assert said == ["2 GPU(s) (profile: 8)", "16.0 GiB per GPU (profile: 24.0)",
                    "119.2 GiB host memory (profile: 1024.0)", "host link 12.5 GB/s per direction (profile: 25.0)"]
    assert (link_bytes_per_s("gen5"), link_bytes_per_s("20"), link_bytes_per_s("20 GB/s")) == (50e9, 20e9, 20e9)
    with pytest.raises(ValueError, match="--pcie expects gen3, gen4, gen5"):
        link_bytes_per_s("gen9")


@pytest.mark.timeout(100)
def test_two_rtx4090_with_128_gib_host(capsys):
    status, out = plan_lines(capsys, ["plan", "--model", "qwen3-1.7b", "--hardware", "rtx4090", "--gpus", "2",
                                      "--host-memory", "128", *FAST])
    assert status == 0 and out[:2] == ["Assumed: 2 GPU(s) (profile: 8)", "Assumed: 128.0 GiB host memory (profile: 1024.0)"]
    assert "on rtx4090 (2 x 24.0 GiB GPUs)" in out[2]
    assert out[3].startswith("Host RAM assumed: 128.0 GiB, from --host-memory 128; 12.8 GiB kept free for the OS")
    assert out[3].endswith(": 115.2 GiB usable for training")  # 10% headroom
    assert any(line.startswith("Host memory: ") and "needed of 115.2 GiB usable" in line for line in out)
    # a host too small for 1.7B parameters' fp32 state, and a GPU too small for one layer: both refused
    status, out = plan_lines(capsys, ["plan", "--model", "qwen3-1.7b", "--hardware", "rtx4090", "--gpus", "2",
                                      "--host-memory", "16", "--gpu-memory", "0.5", *FAST])
    assert status == 1 and "Verdict: does not fit (host memory, GPU memory)" in out


@pytest.mark.timeout(100)
def test_a_slower_link_slows_the_predicted_step(capsys):
    def step(pcie):
        _, out = plan_lines(capsys, ["plan", "--model", "qwen3-0.6b", "--hardware", "rtx4090", "--gpus", "2",
                                     "--pcie", pcie, *FAST])
        return float(next(l for l in out if l.startswith("Predicted: ")).split()[1])
    assert step("1") > 1.5 * step("gen5")


def test_detect_on_a_machine_without_gpus_says_what_it_assumed(capsys):
    status, out = plan_lines(capsys, ["plan", "--model", "qwen3-0.6b", "--detect", *FAST])
    assert status in (0, 1)
    assert out[0] == "Assumed: profile rtx4090 (the default, rtx4090; --hardware picks another)"
    assert out[1] == "Assumed: no GPU found (torch.cuda sees none): assuming the profile's 8 x 24.0 GiB GPUs"
    assert out[2].startswith("Assumed: found ") and out[2].endswith(" GiB host memory")
    assert "CPU cores" in out[3] and out[4].startswith("Assumed: from profile rtx4090")


def test_detected_gpus_replace_the_profile_and_pick_it_by_name():
    assert profile_for_gpu("NVIDIA H100 80GB HBM3") == "h100"
    assert profile_for_gpu("NVIDIA GeForce RTX 4090") == "rtx4090"
    found = DetectedMachine(4, "NVIDIA H100 80GB HBM3", 80 * GiB, 512 * GiB, 32)
    hw, said = apply_detection(load_hardware("h100"), found)
    assert (hw.num_gpus, hw.gpu_memory_bytes, hw.host_memory_bytes, hw.cpu_optimizer_params_per_s) == (
        4, 80 * GiB, 512 * GiB, 32 * 3.4e8)
    assert said[0] == "found 4 x NVIDIA H100 80GB HBM3 (80.0 GiB each)"


def test_hardware_or_detect_is_required(capsys):
    assert main(["plan", "--model", "qwen3-0.6b"]) == 2
    assert "--hardware is required" in capsys.readouterr().err
