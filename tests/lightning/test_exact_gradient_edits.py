"""User code that edits gradients runs where Lightning runs it: parity with the default strategy.

A callback's ``on_after_backward``, an ``optimizer_step`` override whose closure edits the
gradients, ``param.register_hook`` and ``register_post_accumulate_grad_hook`` on host
parameters; SGD with momentum (no clipping) and AdamW, several backward stages so that layers
could step during backward."""

import lightning as L
import pytest
import torch

from _exact_models import LAYERED, WEIGHT_TOL, SeqModule, parity

STRATEGY = {"microbatches": 2, **LAYERED}


class ZeroAndScaleGrads(L.Callback):
    def on_after_backward(self, trainer, pl_module):
        for p in pl_module.net[1].parameters():
            p.grad.zero_()
        pl_module.net[4].weight.grad.mul_(0.25)


class ClosureEditsGrads(SeqModule):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        def closure():
            loss = optimizer_closure()
            self.net[0][0].weight.grad.mul_(-0.5)
            self.net[3][0].bias.grad.zero_()
            return loss

        optimizer.step(closure=closure)


class TensorHooks(SeqModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # nonlinear in the gradient: exact only if it sees the whole gradient of the backward once
        self.net[2][0].weight.register_hook(lambda g: g.clamp(-0.02, 0.02))
        self.net[0][0].bias.register_hook(lambda g: g * 3.0)


class PostAccumulateHooks(SeqModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = 0

        def halve(p):
            self.seen += 1
            p.grad.mul_(0.5)

        self.net[1][0].weight.register_post_accumulate_grad_hook(halve)


CASES = {
    "callback_on_after_backward": (SeqModule, [ZeroAndScaleGrads]),
    "optimizer_step_closure": (ClosureEditsGrads, []),
    "register_hook": (TensorHooks, []),
    "post_accumulate_grad_hook": (PostAccumulateHooks, []),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradient_edit_matches_default_strategy(case, opt):
    cls, callbacks = CASES[case]
    _, w_err = parity(lambda: cls(opt=opt), max_steps=4, strategy_kwargs=STRATEGY,
                      callbacks=[c() for c in callbacks])
    assert w_err < WEIGHT_TOL, f"{case}/{opt}: weights {w_err:.2e} off the default strategy's"


@pytest.mark.timeout(60)
def test_post_accumulate_hook_fires_once_per_backward():
    """Once per step, on the accumulated gradient (as autograd does for a leaf), also with 2 microbatches."""
    from _models import fit
    from lightning_roundpipe import RoundPipeStrategy

    ref, m = PostAccumulateHooks(), PostAccumulateHooks()
    fit(ref, "auto", max_steps=3, record_grads=False)
    fit(m, RoundPipeStrategy(**STRATEGY), devices=2, max_steps=3, record_grads=False)
    assert (m.seen, ref.seen) == (3, 3)


class HookedLoraFineTune(L.LightningModule):
    """A Hugging Face LM under peft LoRA (the fused last stage scales its gradients at backward)."""

    def __init__(self):
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from tests.adapters.test_hf_pipeline import tiny

        self.model = get_peft_model(tiny("qwen3"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        lora = [p for n, p in self.model.named_parameters() if "lora_B" in n]
        lora[0].register_hook(lambda g: g.clamp(-1e-3, 1e-3))  # layer 0
        lora[-1].register_hook(lambda g: g * 4.0)  # the last layer, in the fused stage

    def training_step(self, b, i):
        return self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


@pytest.mark.timeout(90)
def test_tensor_hooks_on_a_pipelined_hugging_face_model():
    from torch.utils.data import DataLoader

    from _exact_models import weight_error
    from lightning_roundpipe import RoundPipeStrategy
    from tests.adapters.test_hf_pipeline import batch

    def run(strategy, devices):
        torch.manual_seed(0)
        m = HookedLoraFineTune()
        w0 = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
        ids, mask, labels = batch(padded=True, seed=3)
        data = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(5)] * 4
        L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=4, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
            m, DataLoader(data, batch_size=4))
        return {n: p.detach() for n, p in m.named_parameters() if p.requires_grad}, w0

    ref, w0 = run("auto", 1)
    got, _ = run(RoundPipeStrategy(microbatches=2), 2)
    err = weight_error(got, ref, w0)
    assert err < WEIGHT_TOL, f"weights {err:.2e} off the default strategy's"
