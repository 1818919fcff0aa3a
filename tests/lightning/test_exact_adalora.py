"""peft's AdaLoRA as its docs use it (``update_and_allocate`` in ``on_train_batch_end``), pipelined:
the rank allocation reads the weights and gradients of the step that just ended (issue 20, item 3)."""

import lightning as L
import pytest
import torch
from peft import AdaLoraConfig, get_peft_model
from torch.utils.data import DataLoader

from _exact_models import WEIGHT_TOL, weight_error
from lightning_roundpipe import RoundPipeStrategy
from tests.adapters.test_hf_pipeline import batch, tiny

STEPS = 5


class AdaLoraFineTune(L.LightningModule):
    def __init__(self):
        super().__init__()
        config = AdaLoraConfig(target_modules=["q_proj", "v_proj"], init_r=4, target_r=2, tinit=1, tfinal=1,
                               deltaT=1, total_step=STEPS, lora_alpha=8, lora_dropout=0.0)
        self.model = get_peft_model(tiny("qwen3"), config)
        for n, p in self.model.named_parameters():  # start away from zero so every factor gets gradients
            if "lora_E" in n:
                torch.nn.init.normal_(p, std=0.02)

    def training_step(self, b, i):
        return self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss

    def on_train_batch_end(self, outputs, b, i):
        self.model.base_model.update_and_allocate(self.global_step)  # as peft documents it

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _fit(strategy, devices):
    torch.manual_seed(0)
    m = AdaLoraFineTune()
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    ids, mask, labels = batch(padded=True, seed=3)
    data = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(5)] * 4
    L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
        m, DataLoader(data, batch_size=4))
    return m, w0


@pytest.mark.timeout(90)
def test_adalora_update_and_allocate_matches_default_strategy():
    ref, w0 = _fit("auto", 1)
    got, _ = _fit(RoundPipeStrategy(microbatches=2, overlap_optimizer=True, testing={"optimizer_delay_s": 0.01}), 2)
    w_ref = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    w = {n: p.detach() for n, p in got.named_parameters() if p.requires_grad}
    assert len(w) == 3 * 2 * 3  # lora_A, lora_B, lora_E of q_proj and v_proj in 3 layers
    assert weight_error(w, w_ref, {n: w0[n] for n in w}) < WEIGHT_TOL
