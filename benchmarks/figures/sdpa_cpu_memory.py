"""What torch's CPU sdpa kernel and a Hugging Face decoder layer keep, as the CPU backend's memory cap counts it.

Each case runs under ``workers/device_memory.py``'s ``AllocationTally`` (the tally the cap enforces) and prints
the bytes of the new tensors per operator: ``scaled_dot_product_attention`` on fp32 ``[1, 2 heads, L, 8]``
queries (the tiny test llama's attention) with no mask and ``is_causal``, a boolean mask, a float mask, and
``enable_gqa`` with one KV head; then one tiny-llama decoder layer (sdpa and eager, with and without a padded
row) against ``cost/activations.py``'s per-token figures. Workspaces a kernel frees before it returns are not
tensors the tally (or the cap) sees; ``torch.profiler``'s memory events give their peak, printed beside.

    python -m benchmarks.figures.sdpa_cpu_memory [--tokens 4096]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from lightning_roundpipe.workers.device_memory import AllocationTally
from lightning_roundpipe.workers.pool import DeviceMemory

MiB = 2**20


class OperatorTally(AllocationTally):
    """The cap's tally, with the bytes of each operator's new storages added up."""

    def __init__(self) -> None:
        super().__init__(DeviceMemory(worker=0))
        self.per_operator: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.memory.tensor_bytes
        out = super().__torch_dispatch__(func, types, args, kwargs)
        grown = self.memory.tensor_bytes - before
        if grown > 0:
            self.per_operator[str(func).removeprefix("aten.").removesuffix(".default")] += grown
        return out


def all_allocations_peak(fn) -> int:
    """Peak bytes of every CPU allocation while ``fn`` runs (kernel workspaces included)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        current += nbytes
        peak = max(peak, current)
    return peak


def sdpa_case(name: str, tokens: int, mask: str | None, gqa: bool) -> None:
    g = torch.Generator().manual_seed(0)
    kv_heads = 1 if gqa else 2
    q = torch.randn(1, 2, tokens, 8, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, tokens, 8, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, tokens, 8, generator=g, requires_grad=True)
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None]
    attn_mask = {None: None, "bool": causal,
                 "float": torch.zeros(tokens, tokens).masked_fill(~causal[0, 0], float("-inf"))[None, None]}[mask]

    def forward():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=mask is None, enable_gqa=gqa)

    tally = OperatorTally()
    with tally:
        out = forward()
    kept, forward_ops = tally.memory.tensor_bytes, dict(tally.per_operator)
    tally.per_operator.clear()
    tally.memory.reset_peak()
    with tally:
        out.backward(torch.ones_like(out))
    backward_peak = tally.memory.peak_bytes - kept
    del out

    def both():
        forward().backward(torch.ones_like(q))

    print(f"{name:30s} kept {kept / MiB:7.2f} MiB, backward adds {backward_peak / MiB:6.2f} MiB; all allocations "
          f"forward {all_allocations_peak(forward) / MiB:6.2f}, both {all_allocations_peak(both) / MiB:6.2f} MiB")
    print(f"{'':30s} forward: {', '.join(f'{op} {b / MiB:.2f}' for op, b in forward_ops.items())}")
    print(f"{'':30s} backward: {', '.join(f'{op} {b / MiB:.2f}' for op, b in tally.per_operator.items())}")


def decoder_case(attn: str, padded: bool, tokens: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from _family_configs import tiny_model

    from lightning_roundpipe.adapters.hf_causal_lm import CausalLMLayers
    from lightning_roundpipe.cost.activations import (decoder_backward_transient_bytes, decoder_graph_bytes,
                                                      hidden_grad_bytes)
    from lightning_roundpipe.cost.hf_shape import shape_from_config

    model = tiny_model("llama", attn=attn)
    prefix, decoder = CausalLMLayers.from_model(model).layers[:2]
    ids = torch.randint(1, 64, (1, tokens), generator=torch.Generator().manual_seed(0))
    carry = {"input_ids": ids, "labels": ids}
    if padded:
        carry["attention_mask"] = torch.ones_like(ids)
        carry["attention_mask"][0, :5] = 0
    with torch.no_grad():
        carry = prefix(carry)
    carry["hidden"] = carry["hidden"].detach().requires_grad_()
    tally = OperatorTally()
    with tally:
        out = decoder(carry)
    kept = tally.memory.tensor_bytes
    tally.memory.reset_peak()
    with tally:
        out["hidden"].backward(torch.ones_like(out["hidden"]))
    shape, _ = shape_from_config(model.config)
    masks = [f"{tuple(v.shape)} {v.dtype}" for k, v in carry.items() if "mask" in k and torch.is_tensor(v)]
    print(f"decoder layer, {attn:5s}, {'padded' if padded else 'unpadded'}: kept {kept / tokens:7.0f} B/token "
          f"(cost/activations.py without scores or masks: {decoder_graph_bytes(shape, 4, None)}), backward adds "
          f"{(tally.memory.peak_bytes - kept) / tokens:6.0f} B/token (priced: "
          f"{decoder_backward_transient_bytes(shape, 4) + hidden_grad_bytes(shape, 4)}); carried masks {masks or 'none'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    tokens = parser.parse_args(argv).tokens
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {tokens} tokens; one [1, 2, L, L] fp32 "
          f"score tensor would be {2 * tokens * tokens * 4 / MiB:.0f} MiB")
    for gqa in (False, True):
        for mask in (None, "bool", "float"):
            sdpa_case(f"sdpa, mask {mask or 'none (is_causal)'}, gqa {gqa}", tokens, mask, gqa)
    for attn in ("sdpa", "eager"):
        for padded in (False, True):
            decoder_case(attn, padded, min(tokens, 1024))


if __name__ == "__main__":
    main()
