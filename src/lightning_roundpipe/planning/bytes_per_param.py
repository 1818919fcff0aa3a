"""Host bytes per parameter of each way to train, from the memory model (``cost/memory.py``).

``python -m lightning_roundpipe.plan --host-bytes`` prints the table that ``docs/limitations.md`` and
``docs/finetune.md`` show (``scripts/doc_figures.py`` writes it there, a test checks it), so the
docs' bytes-per-parameter figures cannot drift from what the planner prices. The figures are the
training state only, per parameter of the model; the activations saved for recompute come on top
and depend on the sequence, the microbatches and the plan (``sim plan`` prints them).
"""

from __future__ import annotations

from ..cost.hardware import HardwareProfile, load_hardware
from ..cost.memory import host_bytes
from ..cost.transformer import ModelShape, get_model_shape
from .fit import model_costs

DEFAULT_MODEL = "llama-3.1-8b"
LORA_RANK = 16


def bytes_per_param_rows(model: str | ModelShape = DEFAULT_MODEL, hardware: str | HardwareProfile = "rtx4090",
                         lora_rank: int = LORA_RANK) -> list[tuple[str, float, str]]:
    """(training, host bytes per parameter, what they are) for full fine-tuning with and without the
    failed-step undo journal, LoRA and QLoRA (NF4) of ``lora_rank``, each as a Hugging Face model
    computing its own loss runs (a fused last stage)."""
    shape, hw = get_model_shape(model), load_hardware(hardware)
    rows = []
    settings = (("full fine-tuning (default: optimizer_undo=True)", None, None, True),
                ("full fine-tuning, optimizer_undo=False", None, None, False),
                (f"LoRA r={lora_rank}", lora_rank, None, True),
                (f"QLoRA r={lora_rank} (NF4 base, `--quantize nf4`)", lora_rank, "nf4", True))
    for name, rank, quantize, undo in settings:
        h = host_bytes(model_costs(shape, hw, 1024, 1, rank, quantize=quantize), undo=undo)
        per = lambda n: n / h.params  # noqa: E731
        parts = (f"fp32 master, gradient, Adam m and v {per(h.optimizer_state):.2f}; "
                 f"undo journal {per(h.undo_images):.2f} ({h.undo_images / 2**30:.1f} GiB, bounded); "
                 f"upload copy {per(h.compute_copy):.2f}; gradient download buffers {per(h.gradient_downloads):.2f}")
        rows.append((name, per(h.total), parts))
    return rows


def bytes_per_param_table(model: str | ModelShape = DEFAULT_MODEL, hardware: str | HardwareProfile = "rtx4090") -> str:
    """The rows of ``bytes_per_param_rows`` as a Markdown table, with the model they were priced on."""
    shape = get_model_shape(model)
    lines = [f"| training ({shape.name}, bf16 compute) | host bytes per parameter | of which |", "|---|---:|---|"]
    lines += [f"| {name} | {total:.1f} | {parts} |" for name, total, parts in bytes_per_param_rows(model, hardware)]
    return "\n".join(lines)
