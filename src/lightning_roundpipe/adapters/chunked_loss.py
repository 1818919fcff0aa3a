"""Language-model head + cross-entropy without materialising the full logits.

For a large vocabulary and a long sequence the logits are the largest tensor of the step. The
fused last stage computes forward, loss and gradients at once, chunk by chunk of rows, so only
one chunk's logits ever exist and backward scales the stored gradients by the incoming one
(exact). Numerics follow Hugging Face's ``ForCausalLMLoss`` and the caller's autocast; a family's
logit transform (scale, soft-cap: ``LogitTransform``) runs inside each chunk with its
derivative. Details: docs/design.md, design notes, ``adapters/chunked_loss.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..cost.activations import DEFAULT_LOSS_CHUNK_TOKENS  # the chunk default the planner assumes too

LogitsObserver = Callable[[torch.Tensor], None]
"""Debug callback called with every logits chunk the chunked loss creates (used by tests to
prove the O(chunk x vocab) memory bound)."""


@dataclass(frozen=True)
class LogitTransform:
    """``logits * multiplier / divisor``, then ``softcap * tanh(logits / softcap)`` when set.

    The identity by default. Applied in the dtype of the head's output, as the models do.
    """

    multiplier: float = 1.0
    divisor: float = 1.0
    softcap: float | None = None

    @property
    def is_identity(self) -> bool:
        """Whether the transform leaves logits unchanged (no scaling, no soft-capping)."""
        return self.multiplier == 1.0 and self.divisor == 1.0 and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def softcap_slope(self, transformed: torch.Tensor) -> torch.Tensor | None:
        """d(softcapped)/d(input) = 1 - tanh^2 as fp32, from the transform's output; None without a cap."""
        if self.softcap is None:
            return None
        tanh = transformed.float() / self.softcap
        return 1.0 - tanh * tanh

    def backward_(self, grad: torch.Tensor, slope: torch.Tensor | None) -> torch.Tensor:
        """Chain rule through the transform, in place on ``grad`` (fp32); ``slope`` from ``softcap_slope``."""
        if slope is not None:
            grad.mul_(slope)
        if self.multiplier != 1.0:
            grad.mul_(self.multiplier)
        if self.divisor != 1.0:
            grad.div_(self.divisor)
        return grad


IDENTITY = LogitTransform()


def plain_lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
) -> torch.Tensor:
    """Reference: full logits, ``transform``, fp32 upcast, summed cross-entropy (0-dim fp32).

    Args:
        hidden: [n, h] rows fed to the LM head.
        weight: [vocab, h] LM head weight.
        labels: [n] target ids; rows equal to ``ignore_index`` contribute nothing.
        ignore_index: label value to skip.
        bias: optional [vocab] LM head bias.
        transform: what the model does to its logits before the loss.
    """
    logits = transform(F.linear(hidden, weight, bias)).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def chunked_lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = -100,
    bias: torch.Tensor | None = None,
    on_logits_chunk: LogitsObserver | None = None,
    transform: LogitTransform = IDENTITY,
    grad_scale: float | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, chunked.

    Equals ``plain_lm_head_loss`` (up to summation order) while holding at most
    ``chunk_size x vocab`` logits at a time. When autograd needs gradients (grad mode on and an
    input requires grad), they are computed in the same pass, so backward costs one multiply.

    Memory: one [chunk_size, vocab] fp32 logits buffer (plus its low-precision copy for
    non-fp32 inputs), the [n, h] gradient of ``hidden`` and, when ``weight`` requires grad, an
    fp32 [vocab, h] accumulator for its gradient (fp32 so that summing many chunks loses nothing
    in bf16). Only the [n, h] gradient grows with the sequence.

    Args:
        hidden: [n, h] rows (already through the final norm).
        weight: [vocab, h] LM head weight.
        labels: [n] integer targets (already shifted); ``ignore_index`` rows are skipped.
        chunk_size: rows per chunk; bounds the logits memory.
        ignore_index: label value to skip.
        bias: optional [vocab] LM head bias.
        on_logits_chunk: debug callback receiving every logits chunk (see ``LogitsObserver``).
        transform: what the model does to its logits before the loss (scaling, soft-capping).
        grad_scale: the gradient the returned sum is expected to get in backward (the caller's
            1 / tokens): the logits gradient is multiplied by it before it is rounded to the head's
            dtype, as the model's mean loss does, and backward then multiplies by the ratio of the
            gradient it gets to this one (exactly 1 when as expected). None: 1.

    Returns:
        0-dim fp32 tensor: the sum (not the mean) of the per-token losses.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            "chunked_lm_head_loss expects hidden [n, h], weight [vocab, h], labels [n]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if hidden.shape[0] != labels.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"labels {tuple(labels.shape)} (need hidden [n, h], weight [vocab, h], labels [n])"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    differentiable = [hidden, weight] + ([bias] if bias is not None else [])
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in differentiable)
    device_type = hidden.device.type
    autocast_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    with torch.autocast(device_type, enabled=False):  # the Function applies autocast's casts itself
        return _ChunkedLMHeadLoss.apply(
            hidden, weight, bias, labels, chunk_size, ignore_index, wants_grad, on_logits_chunk, transform,
            autocast_dtype, grad_scale
        )


class _ChunkedLMHeadLoss(torch.autograd.Function):
    """Forward computes loss and (optionally) gradients; backward rescales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, ignore_index, wants_grad, observer, transform,
                autocast_dtype, grad_scale):
        rows = hidden.shape[0]
        # The head's compute dtype: autocast's when the caller's autocast is on, else the input's.
        low = autocast_dtype or hidden.dtype
        head_weight = weight.to(low)
        head_bias = None if bias is None else bias.to(low)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if wants_grad else None
        # A frozen head (LoRA) needs no fp32 [vocab, h] accumulator: at long sequences that is memory the
        # worker does not have to spare.
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if wants_grad and weight.requires_grad else None)
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if wants_grad and bias is not None
            else None
        )
        for start in range(0, rows, chunk_size):
            stop = min(start + chunk_size, rows)
            h = hidden[start:stop].to(low)
            target = labels[start:stop]
            # Head and transform in the input dtype, then upcast: what HF's forward + ForCausalLMLoss do.
            transformed = transform(F.linear(h, head_weight, head_bias))
            slope = transform.softcap_slope(transformed)  # before the in-place softmax below reuses the buffer
            logits = transformed.float()
            if observer is not None:
                observer(logits)
            valid = target != ignore_index
            safe_target = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(1)
            log_norm = torch.logsumexp(logits, dim=1)
            target_logit = logits.gather(1, safe_target).squeeze(1)
            total += torch.where(valid, log_norm - target_logit, torch.zeros_like(log_norm)).sum()
            if not wants_grad:
                continue
            # d(loss)/d(logits) = softmax - one_hot, zero on ignored rows; built in place in the
            # logits buffer so the chunk never needs a second fp32 [chunk, vocab] tensor.
            grad_logits = logits.sub_(log_norm.unsqueeze(1)).exp_()
            grad_logits.scatter_add_(1, safe_target, torch.full_like(safe_target, -1, dtype=grad_logits.dtype))
            grad_logits.mul_(valid.unsqueeze(1).to(grad_logits.dtype))
            if not transform.is_identity:
                grad_logits = transform.backward_(grad_logits, slope)
            if grad_scale is not None:
                grad_logits.mul_(grad_scale)  # before the rounding below, as the mean loss's gradient is
            grad_low = grad_logits.to(low)  # no copy in fp32
            grad_hidden[start:stop] = grad_low @ head_weight
            if grad_weight is None:
                pass
            elif low == torch.float32:
                grad_weight.addmm_(grad_low.t(), h)
            else:
                grad_weight += grad_low.t() @ h
            if grad_bias is None:
                pass
            elif autocast_dtype is None:
                grad_bias += grad_logits.sum(0)
            else:
                grad_bias += grad_low.sum(0)  # autocast's linear sums the bias gradient in its dtype
            del logits, grad_logits, grad_low, transformed, slope
        # In fp32, the gradient backward is expected to get (the loss path multiplies an fp32 sum).
        ctx.grad_scale = None if grad_scale is None else torch.tensor(grad_scale, dtype=torch.float32)
        ctx.grad_hidden = grad_hidden
        ctx.grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        ctx.grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        if ctx.grad_hidden is None:
            raise RuntimeError(
                "chunked_lm_head_loss: backward called but gradients were not computed in forward "
                "(forward ran with grad disabled or with no input requiring grad)"
            )
        scale = grad_output
        if ctx.grad_scale is not None:
            # Exactly 1 when as expected, and x * 1 == x: no branch, so no device sync to read it.
            scale = grad_output / ctx.grad_scale.to(grad_output.device)
        # The stored gradients stay on ctx (freed with the graph) so retain_graph works.
        grads = [
            ctx.grad_hidden * scale.to(ctx.grad_hidden.dtype) if ctx.needs_input_grad[0] else None,
            ctx.grad_weight * scale.to(ctx.grad_weight.dtype) if ctx.needs_input_grad[1] else None,
            ctx.grad_bias * scale.to(ctx.grad_bias.dtype)
            if ctx.grad_bias is not None and ctx.needs_input_grad[2]
            else None,
        ]
        return (*grads, *[None] * 9)
