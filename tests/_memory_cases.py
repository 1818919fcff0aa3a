"""The memory-sweep cases: a tiny Hugging Face causal LM per case, trained one step on the CPU backend
with device memory measured, beside the planner's prediction of each worker's peak.

Shared by tests/cost/test_memory_sweep.py, tests/planning/test_memory_longest.py and
``benchmarks/validation/memory_sweep.py`` (the full sweep).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import tempfile
import time
from dataclasses import dataclass

import torch

from lightning_roundpipe.cost.hardware import load_hardware
from lightning_roundpipe.cost.memory import roundpipe_gpu_bytes
from lightning_roundpipe.cost.transformer import ModelShape, shape_layer_costs

LOSS_CHUNK_TOKENS = 1024  # CausalLMPostfix's chunk of the loss (hf_layers.py)
ERROR_BOUND = 0.10  # the bound on |predicted - measured| / measured


@dataclass(frozen=True)
class MemoryCase:
    """One sweep point: a model shape, a sequence length, a plan and how the step is run."""

    family: str = "qwen3"
    hidden: int = 32
    layers: int = 2  # decoder layers (the pipelined module has layers + 2: embedding and head)
    seq_len: int = 256
    forward: str = "0:2 2:4"  # plan cuts over the layers + 2 pipelined layers
    backward: str = "0:1 1:2 2:4"  # a fused last stage is cut alike in both directions
    fused: bool = True  # loss inside the pipeline (labels given) or on the host from the logits
    lora: bool = False
    workers: int = 2
    microbatches: int = 2
    batch: int = 2  # sequences per step (microbatch_size = batch / microbatches)
    vocab: int = 256

    @property
    def label(self) -> str:
        return (f"{self.family} h{self.hidden} L{self.layers} seq {self.seq_len:>5} F {self.forward} | B {self.backward}"
                f"{' fused' if self.fused else ''}{' lora' if self.lora else ''} w{self.workers} m{self.microbatches}")


def hf_config(case: MemoryCase):
    from transformers import AutoConfig

    heads = 2
    return AutoConfig.for_model(
        case.family, vocab_size=case.vocab, hidden_size=case.hidden, intermediate_size=2 * case.hidden,
        num_hidden_layers=case.layers, num_attention_heads=heads, num_key_value_heads=1, head_dim=case.hidden // heads,
        max_position_embeddings=max(case.seq_len, 64), attention_dropout=0.0, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")


def model_shape(case: MemoryCase):
    """The planner's :class:`ModelShape` of ``case``'s config."""
    c = hf_config(case)
    return ModelShape(f"tiny-{case.family}", c.hidden_size, c.intermediate_size, c.num_attention_heads,
                      c.num_key_value_heads, c.head_dim, c.vocab_size, c.num_hidden_layers,
                      tie_embeddings=bool(c.tie_word_embeddings), qk_norm=case.family == "qwen3")


def lora_rank(case: MemoryCase) -> int | None:
    return 4 if case.lora else None


def load_model(case: MemoryCase, directory: str):
    """Build from the config, ``save_pretrained``, ``from_pretrained`` (fp32), and wrap in LoRA if asked."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config(case)).save_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
    if case.lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=lora_rank(case), lora_alpha=8, target_modules=targets))
    return model.train()


def plan_of(case: MemoryCase):
    from lightning_roundpipe.schedule.plan import Plan

    return Plan.from_text(f"F {case.forward} | B {case.backward}" + (" | fused" if case.fused else ""))


def predicted_bytes(case: MemoryCase, cap_bytes: int | None = None) -> list[int]:
    """The planner's per-worker peak for ``case`` (what ``roundpipe_gpu_bytes`` says)."""
    costs = shape_layer_costs(model_shape(case), load_hardware("cpu2"), case.seq_len,
                              microbatch_size=case.batch / case.microbatches, dtype_bytes=4, lora_rank=lora_rank(case),
                              loss_chunk_tokens=LOSS_CHUNK_TOKENS, loss_in_pipeline=case.fused)
    # The CPU backend's transfers are memory copies: nothing is still on its way at a peak.
    return roundpipe_gpu_bytes(plan_of(case), costs, case.workers, continue_round_robin=False,
                               link_bytes_per_second=math.inf, microbatches=case.microbatches)


def run_case(case: MemoryCase, cap_bytes: int | None = None, steps: int = 1, measure: bool = True,
             seconds: list | None = None) -> list[int]:
    """Train ``steps`` steps of ``case`` on the CPU backend; return each worker's measured peak bytes.

    With ``cap_bytes`` each worker is a virtual GPU of that size (``cpu_memory_cap_bytes``): a step
    that does not fit raises :class:`~lightning_roundpipe.workers.device_memory.WorkerOutOfMemoryError`.
    """
    from lightning_roundpipe.options import PartitionConfig, RuntimeOptions
    from lightning_roundpipe.runtime import RoundPipeRuntime

    with tempfile.TemporaryDirectory() as directory:
        model = load_model(case, directory)
        opts = RuntimeOptions(microbatches=case.microbatches, recompute="always", overlap_optimizer=False,
                              step_metrics=False, cpu_memory_cap_bytes=cap_bytes,
                              partition=PartitionConfig(policy="manual", manual_forward=_ranges(case.forward),
                                                        manual_backward=_ranges(case.backward)))
        rt = RoundPipeRuntime.attach(model, "cpu", case.workers, opts)
        try:
            if cap_bytes is None and measure:
                rt.pool.start_measuring_memory()
            gen = torch.Generator().manual_seed(1)
            ids = torch.randint(3, case.vocab, (case.batch, case.seq_len), generator=gen)
            for _ in range(steps):
                start = time.perf_counter()
                if case.fused:
                    loss = model(input_ids=ids, labels=ids).loss
                else:
                    logits = model(input_ids=ids).logits
                    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, case.vocab).float(),
                                                             ids[:, 1:].reshape(-1))
                loss.backward()
                model.zero_grad(set_to_none=True)
                if seconds is not None:
                    seconds.append(time.perf_counter() - start)
            return rt.pool.peak_device_bytes()
        finally:
            rt.detach()
            del model
            gc.collect()


def _ranges(text: str) -> list[list[int]]:
    return [[int(a) for a in r.split(":")] for r in text.split()]


def compare(case: MemoryCase) -> dict:
    measured = run_case(case)
    predicted = predicted_bytes(case)
    errors = [(p - m) / m for p, m in zip(predicted, measured)]
    worst = max(range(len(errors)), key=lambda i: abs(errors[i]))
    return {"case": case.label, "measured": measured, "predicted": predicted, "errors": errors,
            "worst_error": errors[worst], "max_error": (max(predicted) - max(measured)) / max(measured)}


def sweep_cases(quick: bool = False) -> list[MemoryCase]:
    """The sweep: sequence lengths 256 to 16K, three plans, fused or not, LoRA or full, Qwen3 and Llama."""
    base = MemoryCase()
    plans = [("0:2 2:4", "0:1 1:2 2:4"), ("0:1 1:3 3:4", "0:1 1:3 3:4"), ("0:3 3:4", "0:1 1:2 2:3 3:4")]
    if quick:
        return [base,
                dataclasses.replace(base, seq_len=1024, fused=False),
                dataclasses.replace(base, family="llama", seq_len=512, lora=True, forward=plans[1][0], backward=plans[1][1]),
                dataclasses.replace(base, seq_len=2048, hidden=64, lora=True, fused=False, forward=plans[2][0],
                                    backward=plans[2][1], workers=1)]
    out = []
    for seq in (256, 1024, 4096, 16384):
        for k, (fwd, bwd) in enumerate(plans):
            for fused in (True, False):
                for lora in (False, True):
                    family = "qwen3" if (k + lora) % 2 == 0 else "llama"
                    out.append(dataclasses.replace(base, family=family, seq_len=seq, forward=fwd, backward=bwd,
                                                   fused=fused, lora=lora, hidden=64 if seq >= 4096 else 32))
    return out
