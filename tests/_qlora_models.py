"""QLoRA models built the two ways users build them, tiny, for tests/params/test_qlora_pipeline.py.

- transformers + bitsandbytes: a tiny config saved with ``save_pretrained`` and loaded through
  ``from_pretrained(quantization_config=BitsAndBytesConfig(nf4, double quantization))``, then
  ``peft.prepare_model_for_kbit_training`` and ``get_peft_model`` (LoRA on q, v, up and down);
- torchao's ``NF4Tensor`` as torchtune builds it: frozen NF4 base weights called through
  ``linear_nf4``, with LoRA adapters beside them.

The summation-order floors the parity bounds are multiples of (Lightning's default strategy against
itself, one batch of 6 against 3 accumulated batches of 2, 3 steps, worst per-tensor weight error):

    python -m tests._qlora_models     # from the repository root; prints each model's floor

``python -m tests._qlora_models --uploads`` measures the weight bytes one training step uploads on the
CPU backend (2 workers, 3 microbatches, two stages each way), QLoRA against bf16 LoRA of the same model.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 96
STEPS = 3
BATCH = 6  # split into 3 microbatches of 2


def bnb_qlora_model(arch: str, path, hidden: int = 64, layers: int = 2, compute_dtype=torch.float32, dora: bool = False):
    """A tiny ``arch`` causal LM, saved to ``path`` and loaded back in 4-bit NF4 with double quantization,
    prepared for k-bit training and wrapped with LoRA (r=4; DoRA with ``dora``) on q, v, up and down."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    if not (path / "config.json").exists():
        torch.manual_seed(0)
        extra = dict(head_dim=16) if arch == "qwen3" else {}
        config = AutoConfig.for_model(arch, vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False, **extra)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=compute_dtype)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32,
                                                 attn_implementation="eager")
    model = prepare_model_for_kbit_training(model)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                      init_lora_weights="gaussian", use_dora=dora)  # B != 0: every adapter tensor gets a gradient at once
    model = get_peft_model(model, lora)
    model.train()  # from_pretrained returns the model in eval mode
    return model


class NF4LoraLinear(nn.Module):
    """torchtune's LoRALinear over a frozen NF4 base: ``linear_nf4(x, weight)`` plus the scaled adapter."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        self.weight = nn.Parameter(to_nf4(torch.randn(d_out, d_in) * d_in ** -0.5), requires_grad=False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)
        self.scaling = alpha / rank

    def forward(self, x):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x)) * self.scaling


class NF4Block(nn.Module):
    """A pre-norm MLP block of two NF4 LoRA linears (a decoder's MLP, torchtune style)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.up = NF4LoraLinear(width, 2 * width)
        self.down = NF4LoraLinear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def nf4_model(width: int = 128, depth: int = 4) -> nn.Sequential:
    """Embedding, ``depth`` NF4 LoRA blocks, a head (frozen, as QLoRA trains adapters only)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, width), *[NF4Block(width) for _ in range(depth)],
                          nn.RMSNorm(width), nn.Linear(width, VOCAB))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


class QLoraLM(L.LightningModule):
    """Trains ``model``'s trainable tensors on next-token prediction with SGD (no clipping) or AdamW."""

    def __init__(self, model: nn.Module, opt: str):
        super().__init__()
        self.model, self.opt = model, opt

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        if isinstance(self.model, nn.Sequential):
            logits = self.model(ids)
            return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.opt == "sgd":
            return torch.optim.SGD(params, lr=0.5)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def data() -> TensorDataset:
    """12 sequences of 10 tokens."""
    return TensorDataset(torch.randint(0, VOCAB, (12, 10), generator=torch.Generator().manual_seed(3)))


def fit(module: QLoraLM, strategy="auto", devices: int = 1, batch_size: int = BATCH, **trainer_kwargs) -> None:
    """``STEPS`` optimizer steps of ``module`` on ``data()``."""
    L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              **trainer_kwargs).fit(module, DataLoader(data(), batch_size=batch_size))


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the trainable tensors, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def floor(make, opt: str, **trainer_kwargs) -> float:
    """Weight error of the default strategy against itself: one batch of ``BATCH`` against 3 accumulated
    batches of a third of it (the pipeline's 3 microbatches), ``STEPS`` steps."""
    from _models import weight_error

    whole, split = QLoraLM(make(), opt), QLoraLM(make(), opt)
    w0 = trainable(whole.model)
    fit(whole, **trainer_kwargs)
    fit(split, batch_size=BATCH // 3, accumulate_grad_batches=3, **trainer_kwargs)
    return weight_error(trainable(split.model), trainable(whole.model), w0)


def step_upload_bytes(model) -> int:
    """Weight bytes that land on the workers in one training step of ``model`` on the CPU backend."""
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
    from lightning_roundpipe.params.weights import StageWeights

    moved = [0]
    real_store = StageWeights.store_chunk

    def store_chunk(self, chunk, device_tensors):
        moved[0] += sum(t.numel() * t.element_size() for t in device_tensors)
        return real_store(self, chunk, device_tensors)

    rt = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(
        microbatches=3, partition={"policy": "uniform", "forward_stages": 2, "backward_stages": 2}))
    StageWeights.store_chunk = store_chunk
    try:
        (ids,) = data()[:BATCH]
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        StageWeights.store_chunk = real_store
        rt.detach()
    return moved[0]


def upload_bytes(path, hidden: int = 256) -> dict[str, int]:
    """The weight bytes one training step uploads, QLoRA against bf16 LoRA (bf16 base, bf16 adapters) of one
    model, and the decoder layers' base linear weights alone, as uploaded (4-bit: every part)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_roundpipe.params.packed import upload_parts

    def linear_bytes(model) -> int:
        weights = [p for n, p in model.named_parameters() if ".layers." in n and "lora_" not in n and p.dim() == 2]
        return sum(x.numel() * x.element_size() for x in upload_parts(weights))

    qlora_model = bnb_qlora_model("llama", path, hidden=hidden)
    qlora = step_upload_bytes(qlora_model)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    bf16 = step_upload_bytes(lora.train())
    return {"qlora": qlora, "bf16": bf16, "qlora_linear": linear_bytes(qlora_model), "bf16_linear": linear_bytes(lora)}


def upload_figures(path, hidden: int = 256) -> None:
    """Print ``upload_bytes`` (docs/qlora.md quotes it; scripts/guide_figures.py checks the page)."""
    up = upload_bytes(path, hidden)
    qlora, bf16, q, b = up["qlora"], up["bf16"], up["qlora_linear"], up["bf16_linear"]
    print(f"tiny llama (hidden {hidden}, 2 layers), weight upload bytes per step: QLoRA {qlora:,}, "
          f"bf16 LoRA {bf16:,} ({bf16 / qlora:.2f}x; QLoRA keeps the embedding, head, norms and adapters in fp32, "
          f"as prepare_model_for_kbit_training makes them)")
    print(f"the decoder layers' base linear weights, one upload: QLoRA {q:,} (4-bit bytes and quantization state), "
          f"bf16 {b:,} ({b / q:.2f}x)")


def main() -> None:
    import sys
    import tempfile
    from pathlib import Path

    sys.path[:0] = [str(Path(__file__).resolve().parent)]
    if "--uploads" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            upload_figures(Path(tmp))
        return
    for opt in ("sgd", "adamw"):
        for arch in ("llama", "qwen3"):
            with tempfile.TemporaryDirectory() as tmp:
                print(f"bitsandbytes {arch} {opt}: floor {floor(lambda: bnb_qlora_model(arch, Path(tmp)), opt):.3g}")
        print(f"torchao NF4 {opt}: floor {floor(nf4_model, opt):.3g}")


if __name__ == "__main__":
    main()
