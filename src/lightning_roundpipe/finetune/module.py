"""Fine-tuning of a Hugging Face causal LM as a plain LightningModule, with optional LoRA.

Nothing here knows about RoundPipe: it is the module a user would write for any strategy (the
model computes its own loss from ``labels``), which is the point. Validation perplexity is
computed from the token-weighted mean loss rather than from logits, because a pipelined model
given ``labels`` returns only the loss (under RoundPipe reading ``out.logits`` then raises
``LogitsNotComputedError``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import lightning.pytorch as pl
import torch
from torchmetrics.aggregation import SumMetric
from transformers import AutoModelForCausalLM

from .checks import FineTuneInputError, check_batch, check_model_path
from .data import IGNORE_INDEX


@dataclass
class LoraOptions:
    """Low-rank adapters (peft ``LoraConfig``) on the named linear layers; base weights frozen.

    r: rank of the adapters. alpha: scaling numerator (update scaled by alpha / r).
    dropout: dropout on the adapter input. target_modules: names of the wrapped linear layers.
    """

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    @classmethod
    def parse(cls, value: "LoraOptions | Mapping[str, Any] | None") -> "LoraOptions | None":
        """``None`` or a mapping with ``enabled: false`` means no LoRA; other keys are the fields."""
        if value is None or isinstance(value, LoraOptions):
            return value
        options = dict(value)
        if not options.pop("enabled", True):
            return None
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise FineTuneInputError(f"unknown lora options {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        if "target_modules" in options:
            options["target_modules"] = list(options["target_modules"])
        return cls(**options)


@dataclass
class OptimOptions:
    """AdamW on the trainable parameters, with a per-step learning-rate schedule.

    lr: peak learning rate. weight_decay: applied to matrices only (not to norms and biases).
    betas, eps: AdamW's. warmup_steps: linear ramp from lr/warmup_steps to lr.
    schedule: "linear" decays linearly to 0 at the last step after warmup; "constant" stays at lr.
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "linear"

    @classmethod
    def parse(cls, value: "OptimOptions | Mapping[str, Any] | None") -> "OptimOptions":
        """Defaults for ``None``; a mapping overrides the named fields."""
        if value is None:
            return cls()
        if isinstance(value, OptimOptions):
            return value
        options = dict(value)
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise FineTuneInputError(f"unknown optim options {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        if "betas" in options:
            options["betas"] = tuple(options["betas"])
        parsed = cls(**options)
        if parsed.schedule not in ("linear", "constant"):
            raise FineTuneInputError(f"optim.schedule={parsed.schedule!r}; choose 'linear' or 'constant'.")
        parsed.check_values()
        return parsed

    def check_values(self) -> None:
        """Refuse values AdamW would refuse only when the optimizer is built (after a validation pass)."""
        def number(v):
            return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

        betas_ok = len(self.betas) == 2 and all(number(b) and 0 <= b < 1 for b in self.betas)
        rules = [("lr", self.lr, number(self.lr) and self.lr > 0, "a finite number > 0"),
                 ("weight_decay", self.weight_decay, number(self.weight_decay) and self.weight_decay >= 0,
                  "a finite number >= 0"),
                 ("betas", list(self.betas), betas_ok, "two numbers in [0, 1)"),
                 ("eps", self.eps, number(self.eps) and self.eps > 0, "a finite number > 0"),
                 ("warmup_steps", self.warmup_steps, isinstance(self.warmup_steps, int) and
                  not isinstance(self.warmup_steps, bool) and self.warmup_steps >= 0, "a whole number >= 0")]
        for name, value, ok, rule in rules:
            if not ok:
                raise FineTuneInputError(f"optim.{name}={value!r}: must be {rule}; change it on the command line "
                                         f"(`python examples/finetune.py optim.{name}=...`) or in conf/config.yaml.")


def lr_factor(step: int, warmup_steps: int, total_steps: int | None, schedule: str) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    remaining = total_steps - step
    return max(0.0, remaining / max(1, total_steps - warmup_steps))


def target_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that a shifted causal-LM loss averages over (labels after the first, not ignored)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


class CausalLMFineTune(pl.LightningModule):
    """Fine-tunes ``AutoModelForCausalLM.from_pretrained(model_path)`` on dict batches.

    Args:
        model_path: local Hugging Face model directory.
        lora: ``None`` (full fine-tuning) or LoRA options (``LoraOptions`` or a dict of its
            fields, ``enabled: false`` meaning off).
        optim: optimizer and schedule (``OptimOptions`` or a dict of its fields).
        dtype: dtype to load the weights in (``None`` = as saved, e.g. "bfloat16").

    Logs ``train_loss`` per step, ``val_loss`` (token-weighted) and ``val_ppl`` per validation run.
    """

    def __init__(
        self,
        model_path: str | Path,
        lora: LoraOptions | Mapping[str, Any] | None = None,
        optim: OptimOptions | Mapping[str, Any] | None = None,
        dtype: str | None = None,
    ):
        super().__init__()
        self.model_path = check_model_path(model_path)
        self.lora = LoraOptions.parse(lora)
        self.optim = OptimOptions.parse(optim)
        self.save_hyperparameters(
            {
                # As given, not normalized: Lightning refuses a DataModule whose hparams hold the same key with
                # another type (its save_hyperparameters() keeps a Path as a Path), so equal inputs must save equal.
                "model_path": model_path,
                "lora": asdict(self.lora) if self.lora else None,
                "optim": asdict(self.optim),
                "dtype": dtype,
            }
        )
        load_kwargs = {}
        if dtype is not None:
            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise FineTuneInputError(f"model.dtype={dtype!r} is not a torch dtype; use e.g. float32, bfloat16 or null.")
            load_kwargs["dtype"] = getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, **load_kwargs)
        model.train()  # from_pretrained returns eval mode; Lightning keeps submodule modes as found
        if self.lora is not None:
            model = self._with_lora(model, self.lora)
        self.model = model
        # Sums over the whole validation run, synced across processes when computed.
        self.val_loss_sum = SumMetric()
        self.val_token_sum = SumMetric()

    @staticmethod
    def _with_lora(model: torch.nn.Module, options: LoraOptions) -> torch.nn.Module:
        from peft import LoraConfig, get_peft_model  # imported here: only LoRA runs need it

        config = LoraConfig(
            r=options.r,
            lora_alpha=options.alpha,
            lora_dropout=options.dropout,
            target_modules=list(options.target_modules),
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config)

    @property
    def uses_lora(self) -> bool:
        """True when the model carries LoRA adapters."""
        return self.lora is not None

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Any:
        """The Hugging Face output for one batch; ``.loss`` is the mean over target tokens."""
        check_batch(batch)
        packed = {}
        if "position_ids" in batch:
            # Packed rows (data.packing): the model separates the samples by their restarting
            # position_ids only without a cache; with one it would attend across them.
            packed = {"position_ids": batch["position_ids"], "use_cache": False}
        return self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            labels=batch["labels"],
            **packed,
        )

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch).loss
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def _reset_val_sums(self) -> None:
        # Reset outside inference mode: a validation run inside fit() uses no_grad, and could not
        # update the inference tensors that a reset inside a previous validate() would leave.
        with torch.inference_mode(False):
            self.val_loss_sum.reset()
            self.val_token_sum.reset()

    def on_validation_epoch_start(self) -> None:
        self._reset_val_sums()

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch).loss.detach()
        tokens = target_token_count(batch["labels"]).to(loss.device)
        self.val_loss_sum.update(loss.float() * tokens)
        self.val_token_sum.update(tokens.float())
        return loss

    def on_validation_epoch_end(self) -> None:
        tokens = self.val_token_sum.compute()
        mean_loss = self.val_loss_sum.compute() / tokens.clamp_min(1)
        self.log("val_loss", mean_loss, prog_bar=True)
        self.log("val_ppl", torch.exp(mean_loss), prog_bar=True)
        self._reset_val_sums()

    def configure_optimizers(self) -> dict:
        trainable = [p for p in self.parameters() if p.requires_grad]
        options = self.optim
        groups = [
            {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": options.weight_decay},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=options.lr, betas=options.betas, eps=options.eps
        )
        total_steps = self.trainer.estimated_stepping_batches
        # Without max_steps or max_epochs the total is infinite: there is no end to decay to.
        total_steps = int(total_steps) if math.isfinite(total_steps) else None
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_factor(
                step, options.warmup_steps, total_steps, options.schedule if total_steps else "constant"
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def save_adapter(self, directory: str | Path) -> Path | None:
        """Write the LoRA adapter (peft ``save_pretrained``) to ``directory``; ``None`` without LoRA."""
        if not self.uses_lora:
            return None
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory)
        return directory
