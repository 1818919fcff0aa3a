"""Every verified Hugging Face decoder family, pipelined, against the unpipelined model.

Per family (tiny random configs from ``_family_configs``, each with its special path switched on)
and per worker count {2, 3}: loss with labels (fused chunked last stage; MoE with the aux loss on),
logits without labels, and peft LoRA, each against the model's own forward: loss within 1e-5
relative, every gradient within 1e-5 per tensor; then 3 SGD steps against the plain single-device
loop (what Lightning's default strategy runs), weights within 1e-4 of the update (plain with 3
workers, LoRA with 2, so each family and variant is stepped once). A tensor whose 3-step update is
below 1e-3 of its own norm (RMSNorm scales of QK norms) is at fp32 resolution, where the
update-relative metric measures rounding; those are bounded by 1e-6 of the weight's norm instead. The Lightning
Trainer itself (RoundPipe against the default strategy) runs for a representative subset in
``test_family_lightning.py``. Padding is on the right with 2 workers and on the left with 3.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from _family_configs import AUX_LOSS_FAMILIES, FAMILY_CONFIGS, TRAIN_MODE_RANDOM, family_batch, lora_targets, tiny_model
from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.adapters.hf_causal_lm import VERIFIED_MODEL_TYPES

LOSS_TOL, GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-5, 1e-4
GRAD_FLOOR = 1e-3  # gradients below this fraction of the largest are at the fp32 floor of backward sums
RESOLVED_UPDATE = 1e-3  # updates below this fraction of the weight's norm are at fp32 resolution after 3 steps
ULP_BOUND = 1e-6  # for those: ||w - w_ref|| <= 1e-6 ||w_init|| (about 8 fp32 ulps)
LORA_LR = 0.5  # LoRA tensors get small gradients from a tiny model; a larger rate resolves their update
LR = 0.2  # moves every weight (norm scales too) well above fp32 resolution in 3 steps, without chaotic dynamics


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def worst_grad_error(got: dict, ref: dict) -> float:
    """Per tensor ||g - g_ref|| / ||g_ref||; a gradient that is structurally almost zero (below
    GRAD_FLOOR of the largest one, e.g. a query bias before a softmax) is measured against that floor."""
    assert got.keys() == ref.keys(), f"gradients differ in which tensors have one: {sorted(got.keys() ^ ref.keys())}"
    floor = GRAD_FLOOR * max(float(g.norm()) for g in ref.values())
    return max(float((got[k] - ref[k]).norm()) / max(float(ref[k].norm()), floor) for k in ref)


def with_lora(model, family):
    conv1d = family == "gpt2"  # GPT-2's Conv1D stores weights transposed: peft needs fan_in_fan_out
    lora = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=lora_targets(family), lora_dropout=0.0,
                                            fan_in_fan_out=conv1d))
    with torch.no_grad():  # LoRA B starts at zero; make every LoRA tensor see a real gradient
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)
    return lora


def set_mode(model, family):
    # Sampled routing cannot draw the same numbers twice in two different runs: compare in eval mode.
    model.train(family not in TRAIN_MODE_RANDOM)
    return model


def call(model, ids, mask, labels, family):
    kwargs = {"output_router_logits": True} if family in AUX_LOSS_FAMILIES else {}
    return model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)


def sgd_steps(model, ids, mask, labels, family, steps=3, lr=LR):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        call(model, ids, mask, labels, family).loss.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def check_cells(family: str, workers: int) -> dict[str, float]:
    """Run every cell for one family and worker count; return the worst errors."""
    padding = "right" if workers == 2 else "left"
    ids, mask, labels = family_batch(padding)
    options = RuntimeOptions(microbatches=workers + 1)
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    for lora in (False, True):
        # 3 SGD steps once per family and variant: plain with 3 workers, LoRA with 2 (keeps the matrix fast).
        steps = lora == (workers == 2)
        model = tiny_model(family)
        if lora:
            model = with_lora(model, family)
        set_mode(model, family)
        init = copy.deepcopy(model)
        ref = call(model, ids, mask, labels, family)
        ref.loss.backward()
        g_ref = grads(model)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            ref_logits = model(input_ids=ids, attention_mask=mask).logits
        runtime = RoundPipeRuntime.attach(model, "cpu", workers, options)
        try:
            out = call(model, ids, mask, labels, family)
            worst["loss"] = max(worst["loss"], abs(out.loss.item() / ref.loss.item() - 1))
            if family in AUX_LOSS_FAMILIES:
                assert abs(out.aux_loss.item() / ref.aux_loss.item() - 1) <= LOSS_TOL
            out.loss.backward()
            worst["grad"] = max(worst["grad"], worst_grad_error(grads(model), g_ref))
            model.zero_grad(set_to_none=True)
            if not lora:
                with torch.no_grad():
                    logits = model(input_ids=ids, attention_mask=mask).logits
                worst["loss"] = max(worst["loss"], rel(logits, ref_logits))
            w_pipe = sgd_steps(model, ids, mask, labels, family, lr=LORA_LR if lora else LR) if steps else None
        finally:
            runtime.detach()
        if not steps:
            continue
        start = {n: p.detach().clone() for n, p in init.named_parameters() if p.requires_grad}
        w_ref = sgd_steps(init, ids, mask, labels, family, lr=LORA_LR if lora else LR)
        for name, ref_w in w_ref.items():
            update = (ref_w - start[name]).norm()
            if 0 < update < RESOLVED_UPDATE * start[name].norm():
                # An update this small relative to the weight (norm scales) sits at fp32 resolution:
                # the update-relative metric is ill-conditioned there, so bound the difference in ulps.
                assert (w_pipe[name] - ref_w).norm() <= ULP_BOUND * start[name].norm(), name
                worst["ulp_bounded"] = worst.get("ulp_bounded", 0) + 1
            elif update > 0:
                worst["measured"] = worst.get("measured", 0) + 1
                error = float((w_pipe[name] - ref_w).norm() / update)
                if error > worst["weight"]:
                    worst["weight"], worst["weight_tensor"], worst["update"] = error, name, float(update)
            else:
                assert torch.equal(w_pipe[name], ref_w), name
    return worst


def test_every_verified_family_has_a_config():
    assert set(FAMILY_CONFIGS) == set(VERIFIED_MODEL_TYPES)


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_family_matches_unpipelined_model(family, workers):
    worst = check_cells(family, workers)
    assert worst["loss"] <= LOSS_TOL, worst
    assert worst["grad"] <= GRAD_TOL, worst
    assert worst["weight"] <= WEIGHT_TOL, worst


if __name__ == "__main__":  # the matrix as a table: python tests/adapters/test_family_parity.py
    import time

    print("| family | workers | loss | gradient | weight | tensors measured / ulp-bounded | wall s |")
    print("|---|---|---|---|---|---|---|")
    for name in sorted(FAMILY_CONFIGS):
        for count in (2, 3):
            began = time.perf_counter()
            errors = check_cells(name, count)
            print(f"| {name} | {count} | {errors['loss']:.1e} | {errors['grad']:.1e} | {errors['weight']:.1e} | "
                  f"{errors.get('measured', 0)} / {errors.get('ulp_bounded', 0)} | {time.perf_counter() - began:.1f} |", flush=True)
