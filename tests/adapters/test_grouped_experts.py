"""``moe_experts="grouped"`` and ``"padded_bmm"``: the grouped experts forward against Hugging Face's per-expert loop.

For every MoE family of the matrix: loss (aux term included), logits and every gradient of the
whole model equal HF's eager loop (1e-6 / 1e-5 relative, fp32 CPU), with every matmul kernel
(``grouped_mm``, the capacity = tokens ``bmm``, and the padded path's one ``bmm`` per projection);
parameters and ``state_dict`` are untouched by the swap. Under the Lightning Trainer, two families
train like the default strategy (SGD and AdamW). The grouped forward reads no tensor on the host.
"""

from __future__ import annotations

import contextlib
import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from _family_configs import AUX_LOSS_FAMILIES, FAMILY_CONFIGS, MOE_FAMILIES, family_batch, tiny_model
from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.adapters import grouped_experts
from lightning_roundpipe.adapters.grouped_experts import (GroupedExpertsForward, gate_of, grouped_experts_forward,
                                                          install_grouped_experts)
from lightning_roundpipe.options import OptionError


def hf_loop_model(family):
    model = tiny_model(family).eval()  # eval: PhiMoE samples its routing in training mode
    model.set_experts_implementation("eager")  # HF's per-expert loop
    return model


def loss_logits_grads(model, family):
    ids, mask, labels = family_batch("right")
    out = model(input_ids=ids, attention_mask=mask, labels=labels,
                output_router_logits=family in AUX_LOSS_FAMILIES)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


@contextlib.contextmanager
def mixtral_attached(moe_experts):
    """Mixtral with HF's loop, its loss and gradients before attaching, then the model attached to 2 CPU workers
    (3 microbatches, layer-grain recompute, logits with the loss) with ``moe_experts``; detached on exit."""
    model = hf_loop_model("mixtral")
    ref, ref_grads = loss_logits_grads(model, "mixtral")
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=3, recompute="layer",
                                                                      logits_with_loss=True, moe_experts=moe_experts))
    try:
        yield model, ref, ref_grads
    finally:
        runtime.detach()


def assert_loss_and_grads_match(got, grads, ref, ref_grads):
    """The loss and the aux loss within 1e-6 relative of the reference's, every reference gradient within 1e-5."""
    assert abs(got.loss.item() / ref.loss.item() - 1) <= 1e-6
    assert abs(got.aux_loss.item() / ref.aux_loss.item() - 1) <= 1e-6
    for name, ref_grad in ref_grads.items():
        assert relative(grads[name], ref_grad) <= 1e-5, name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kernel", ["grouped_mm", "bmm", "padded_bmm"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_grouped_experts_equal_the_hf_loop(family, kernel):
    model = hf_loop_model(family)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref, ref_grads = loss_logits_grads(model, family)
    installed, kept = install_grouped_experts(model, kernel)
    assert kept == [] and len(installed) == sum(type(m).__name__.endswith("Experts") for m in model.modules()) > 0
    assert {forward.kernel for forward in installed} == {kernel}
    got, grads = loss_logits_grads(model, family)
    assert abs(got.loss.item() / ref.loss.item() - 1) <= 1e-6
    if family in AUX_LOSS_FAMILIES:
        assert abs(got.aux_loss.item() / ref.aux_loss.item() - 1) <= 1e-6
    assert relative(got.logits, ref.logits) <= 1e-6
    assert grads.keys() == ref_grads.keys() and any(".experts." in n for n in grads)
    for name, ref_grad in ref_grads.items():
        assert relative(grads[name], ref_grad) <= 1e-5, name
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_the_parity_covers_every_moe_family_of_the_matrix():
    # A family whose tiny config routes over experts must be in MOE_FAMILIES, which the parity above runs.
    routed = {family for family, values in FAMILY_CONFIGS.items() if any("expert" in key for key in values)}
    assert routed == set(MOE_FAMILIES) == {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "gpt_oss",
                                           "deepseek_v3"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kernel", ["grouped_mm", pytest.param("padded_bmm", marks=pytest.mark.slow)])
def test_lora_on_the_expert_tensors_reaches_the_grouped_forward(kernel):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf_loop_model("qwen3_moe"), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                                 target_parameters=["mlp.experts.gate_up_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)
    ref, ref_grads = loss_logits_grads(model, "qwen3_moe")
    installed, kept = install_grouped_experts(model, kernel)
    assert len(installed) == 3 and kept == []
    got, grads = loss_logits_grads(model, "qwen3_moe")
    assert abs(got.loss.item() / ref.loss.item() - 1) <= 1e-6
    assert grads.keys() == ref_grads.keys() and any("experts.lora_A" in n for n in grads)
    for name, ref_grad in ref_grads.items():
        assert relative(grads[name], ref_grad) <= 1e-5, name


def test_the_fallback_kernel_is_taken_when_rows_are_not_16_byte_aligned():
    rows, weight = torch.zeros(5, 6), torch.zeros(2, 6, 4)
    assert not grouped_experts.grouped_kernel_fits(rows, weight)
    assert grouped_experts.grouped_kernel_fits(torch.zeros(5, 8), torch.zeros(2, 8, 4))


def test_an_unmapped_experts_layout_keeps_hf_forward():
    model = hf_loop_model("mixtral")
    experts = model.model.layers[0].mlp.experts
    experts.has_post_expert_norm = True  # a layout the grouped forward does not map
    assert gate_of(experts) is None
    installed, kept = install_grouped_experts(model)
    assert kept == ["model.layers.0.mlp.experts"] and len(installed) == 2
    assert "forward" not in vars(experts)


class Syncs:
    """Every Python-level way to read a tensor on the host, patched to record the call."""

    NAMES = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self.recording(name, original))
        for name in ("nonzero", "where", "unique", "bincount"):
            monkeypatch.setattr(torch, name, self.recording(f"torch.{name}", getattr(torch, name)))

    def recording(self, name, original):
        def call(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)
        return call


@pytest.mark.timeout(60)
def test_the_grouped_forward_reads_nothing_on_the_host(monkeypatch):
    model = hf_loop_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    hidden = torch.randn(24, 16, requires_grad=True)
    index = torch.randint(0, 4, (24, 2))
    index[:, 1] = (index[:, 0] + 1) % 4
    weights = torch.rand(24, 2)
    syncs = Syncs(monkeypatch)
    experts(hidden, index, weights)  # control: HF's loop is caught reading on the host
    assert "torch.where" in syncs.calls and "nonzero" in syncs.calls
    syncs.calls.clear()
    for kernel in ("grouped_mm", "bmm"):
        grouped_experts_forward(experts, hidden, index, weights, gate_of(experts), kernel).sum().backward()
    assert syncs.calls == []
    monkeypatch.undo()
    # and it traces as one graph (a host read would break it); traced fp32 takes the bmm kernel
    compiled = torch.compile(lambda h, i, w: grouped_experts_forward(experts, h, i, w), backend="eager", fullgraph=True)
    out = compiled(hidden, index, weights)
    assert relative(out, grouped_experts_forward(experts, hidden, index, weights, kernel="bmm")) <= 1e-6


@pytest.mark.timeout(60)
def test_the_runtime_swaps_the_experts_and_detach_gives_hf_forward_back():
    with mixtral_attached("grouped") as (model, ref, ref_grads):
        swapped = [m for m in model.modules() if isinstance(vars(m).get("forward"), GroupedExpertsForward)]
        assert len(swapped) == 3
        got, grads = loss_logits_grads(model, "mixtral")  # pipelined, microbatched, layer-grain recompute
        assert grads.keys() == ref_grads.keys()
        assert_loss_and_grads_match(got, grads, ref, ref_grads)
    assert not any("forward" in vars(m) for m in model.modules())
    default = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=2))
    try:
        assert not any(isinstance(vars(m).get("forward"), GroupedExpertsForward) for m in model.modules())
    finally:
        default.detach()


def test_an_unverified_family_keeps_hf_experts_forward(caplog):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("granitemoe", vocab_size=64, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  num_local_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config)
    assert gate_of(model.model.layers[0].block_sparse_moe.experts) is not None  # mappable, yet not verified
    options = RuntimeOptions(microbatches=2, allow_unverified=True, moe_experts="grouped")
    with caplog.at_level("WARNING", logger="lightning_roundpipe.adapters.hf_runtime"):
        runtime = RoundPipeRuntime.attach(model, "cpu", 2, options)
    try:
        assert not any(isinstance(vars(m).get("forward"), GroupedExpertsForward) for m in model.modules())
        assert "GraniteMoeForCausalLM is not a verified family; its experts keep Hugging Face's forward" in caplog.text
    finally:
        runtime.detach()


def test_an_unknown_moe_experts_value_is_refused():
    with pytest.raises(OptionError,
                       match=r"RoundPipeStrategy\(moe_experts='fast'\): use one of 'hf', 'grouped', 'padded_bmm'"):
        RoundPipeStrategy(moe_experts="fast")


class MoEModule(L.LightningModule):
    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        self.grouped = any(isinstance(vars(m).get("forward"), GroupedExpertsForward) for m in self.model.modules())
        return self.model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True).loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def fit(model, strategy, devices, optimizer):
    module = MoEModule(model, optimizer)
    data = DataLoader(TensorDataset(*family_batch("left")), batch_size=6)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}, module.grouped


@pytest.mark.timeout(90)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_grouped_experts_train_like_the_default_strategy(family, optimizer):
    model = tiny_model(family)
    model.set_experts_implementation("eager")  # the reference runs HF's loop
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference, reference_grouped = fit(copy.deepcopy(model), "auto", 1, optimizer)
    pipelined, pipelined_grouped = fit(model, RoundPipeStrategy(microbatches=3, moe_experts="grouped"), 2, optimizer)
    assert pipelined_grouped and not reference_grouped
    assert not any("forward" in vars(m) for m in model.modules())  # detached after fit
    for name, ref in reference.items():
        update = (ref - start[name]).norm()
        assert update > 0, name
        assert (pipelined[name] - ref).norm() / update <= 1e-4, name


def test_the_hydra_strategy_entry_defaults_to_hf_and_takes_grouped():
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from lightning_roundpipe.finetune.config import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        assert compose(config_name="config").strategy.moe_experts == "hf"
        assert compose(config_name="config", overrides=["strategy.moe_experts=grouped"]).strategy.moe_experts == "grouped"
        padded = compose(config_name="config", overrides=["strategy.moe_experts=padded_bmm"]).strategy.moe_experts
        assert padded == "padded_bmm" and RoundPipeStrategy(moe_experts=padded)
