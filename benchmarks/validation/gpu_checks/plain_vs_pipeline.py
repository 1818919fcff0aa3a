"""Throughput and memory of the pipeline against plain single-GPU training of the same model, in one run:
a Qwen3-0.6B shape, 4 x 2048 tokens, bf16 autocast, AdamW (a tiny Qwen3 on the fake driver)."""

from __future__ import annotations

import resource
import threading
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .context import TINY_QWEN3, Ctx
from .performance import CopyBench

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
PIPELINE_STAGES = 8  # forward stages (16 backward) at most: many more than the two stages a worker may hold


def workload(ctx: Ctx) -> tuple[dict, int, int]:
    """(model config, sequences, tokens per sequence)."""
    if ctx.cuda and not ctx.quick:
        return QWEN3_06B, 4, 2048
    if ctx.cuda:
        return QWEN3_06B, 4, 512
    return dict(TINY_QWEN3), 4, 32


def build(config: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(attn_implementation="sdpa", **config))


class OptimizerThreads:
    """The intra-op thread count each optimizer step ran with, by the thread that ran it (a global step hook)."""

    def __init__(self) -> None:
        self.seen: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    def __enter__(self):
        self._handle = register_optimizer_step_pre_hook(self._record)
        return self

    def __exit__(self, *exc):
        self._handle.remove()

    def _record(self, optimizer, args, kwargs):
        with self._lock:
            self.seen.setdefault(threading.current_thread().name, set()).add(torch.get_num_threads())


def memory_peaks(ctx: Ctx) -> dict:
    if not ctx.cuda:
        return dict(allocated_peak_bytes=None, reserved_peak_bytes=None, alloc_retries=None)
    stats = torch.cuda.memory_stats(0)
    return dict(allocated_peak_bytes=torch.cuda.max_memory_allocated(0),
                reserved_peak_bytes=torch.cuda.max_memory_reserved(0), alloc_retries=stats.get("num_alloc_retries", 0))


def reset_peaks(ctx: Ctx) -> None:
    ctx.sync()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(0)


def timed_steps(ctx: Ctx, step, steps: int, finish=lambda: None) -> dict:
    """Seconds of ``steps`` steps after one warm-up step; each step returns when its backward did, ``finish``
    (then a device sync) ends its optimizer tail."""
    step()
    finish()
    reset_peaks(ctx)
    retries = memory_peaks(ctx)["alloc_retries"]
    walls, fwd_bwd = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        finish()
        ctx.sync()
        walls.append(time.perf_counter() - t0)
        fwd_bwd.append(t1 - t0)
    peaks = memory_peaks(ctx)
    if retries is not None:
        peaks["alloc_retries"] -= retries
    step_s = sum(walls) / steps
    return dict(step_s=step_s, fwd_bwd_s=sum(fwd_bwd) / steps, optimizer_tail_s=step_s - sum(fwd_bwd) / steps, **peaks)


def plain_run(ctx: Ctx, config: dict, ids: torch.Tensor, steps: int) -> dict:
    """Plain single-device training: the model on the device, AdamW there (fused on CUDA), bf16 autocast."""
    model = build(config).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if ctx.cuda else {}))
    ids = ids.to(ctx.device)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(ctx.device_type, dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids).loss.backward()
        ctx.sync()

    out = timed_steps(ctx, step, steps, opt.step)
    del model, opt
    if ctx.cuda:
        torch.cuda.empty_cache()
    return out


def stage_bytes(runtime, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Weight bytes the worker's ledger holds for the largest stage (forward and backward stages)
    under ``compute_dtype`` autocast: parameters autocast casts upload in ``compute_dtype``, and
    trainable ones are held as leaves in their masters' dtype (cost/autocast_cast.py's rule)."""
    from lightning_roundpipe.cost.autocast_cast import autocast_cast_parameters, device_dtype

    layers = runtime.layers
    cast = autocast_cast_parameters(layers)

    def held(p: torch.Tensor) -> int:
        upload = compute_dtype if id(p) in cast and p.is_floating_point() else p.dtype
        return p.numel() * device_dtype(p, upload, p.requires_grad).itemsize

    per_layer = [sum(held(p) for p in layer.parameters()) for layer in layers]
    plan = runtime.planner.plan
    return max(sum(per_layer[s.start:s.end]) for s in plan.forward_stages() + plan.backward_stages())


def pipeline_run(ctx: Ctx, config: dict, ids: torch.Tensor, steps: int, out_dir: Path) -> dict:
    """The pipeline on one worker of device 0 with a many-stage partition, AdamW overlapped on the host."""
    from lightning_roundpipe.tracing.chrome import to_chrome_trace

    model = build(config)
    layers = config["num_hidden_layers"] + 2  # the pipeline's layers: embedding prefix, decoder layers, head
    t0 = time.perf_counter()
    runtime = ctx.runtime(model, 1, compute_dtype=torch.bfloat16, trace_steps=steps + 1,
                          partition=dict(policy="uniform", forward_stages=min(PIPELINE_STAGES, layers),
                                         backward_stages=min(2 * PIPELINE_STAGES, layers)))
    attach_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    runtime.overlap_optimizer(opt)
    try:
        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device_type, dtype=torch.bfloat16):
                model(input_ids=ids, labels=ids).loss.backward()

        def finish():
            opt.step()
            runtime.join()

        with OptimizerThreads() as threads:
            out = timed_steps(ctx, step, steps, finish)
        records = runtime.trace.records(runtime.kept_steps[-1]) if runtime.kept_steps else []
        to_chrome_trace(records, out_dir / "trace.json")
        ups = [r for r in records if r.queue == "upload" and r.kind == "weights" and r.duration > 0]
        out.update(attach_s=attach_s, stages=len(runtime.planner.plan.forward_stages()) + len(
            runtime.planner.plan.backward_stages()), largest_stage_bytes=stage_bytes(runtime),
            peak_weight_bytes=max(runtime.pool.peak_weight_bytes()), pinned_bytes=runtime.pool.pinned_host_bytes(),
            optimizer_threads={name: sorted(n) for name, n in threads.seen.items()},
            upload_gbps=(sum(r.bytes for r in ups) / sum(r.duration for r in ups) / 1e9) if ups else None)
        return out
    finally:
        runtime.detach()


def bare_copies(ctx: Ctx) -> dict:
    if not ctx.cuda:
        return dict(h2d_gbps=None, d2h_gbps=None, note="fake driver: no link to time")
    bench = CopyBench(0, (64 if ctx.quick else 256) << 20)
    return dict(h2d_gbps=bench.gbps(True, 5), d2h_gbps=bench.gbps(False, 5))


def memory_summary(result: dict) -> str:
    """The memory summary file's text: one line per figure."""
    lines = []
    for run in ("plain", "pipeline"):
        for key, value in result[run].items():
            if "bytes" in key or "retries" in key:
                lines.append(f"{run}.{key} = {value}")
    lines.append(f"host max RSS bytes = {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}")
    return "\n".join(lines) + "\n"


def check_plain_vs_pipeline(ctx: Ctx, out_dir: Path) -> tuple[str, str, dict]:
    config, sequences, seq = workload(ctx)
    ids = torch.randint(0, config["vocab_size"], (sequences, seq), generator=torch.Generator().manual_seed(0))
    steps = 2 if ctx.quick else 3
    result = dict(model=config, sequences=sequences, seq=seq, steps=steps)
    result["plain"] = plain_run(ctx, config, ids, steps)
    result["pipeline"] = pipeline_run(ctx, config, ids, steps, out_dir)
    result["bare_copies"] = bare_copies(ctx)
    tokens = sequences * seq
    for run in ("plain", "pipeline"):
        result[run]["tokens_per_s"] = tokens / result[run]["step_s"]
    (out_dir / "memory.txt").write_text(memory_summary(result))
    pipe = result["pipeline"]
    bound = 2 * pipe["largest_stage_bytes"]
    ok = pipe["peak_weight_bytes"] <= bound and pipe["stages"] > 4
    if ctx.cuda:
        ok = ok and pipe["alloc_retries"] == 0
    ratio = pipe["tokens_per_s"] / result["plain"]["tokens_per_s"]
    summary = (f"tokens/s pipeline {pipe['tokens_per_s']:.0f} vs plain {result['plain']['tokens_per_s']:.0f} "
               f"({ratio:.2f}x); peak weights {pipe['peak_weight_bytes'] / 2**20:.1f} MiB vs 2 x largest stage "
               f"{bound / 2**20:.1f} MiB ({pipe['stages']} stages); optimizer threads {pipe['optimizer_threads']}; "
               f"retries {pipe['alloc_retries']}; upload {pipe['upload_gbps'] or 0:.1f} GB/s vs bare H2D "
               f"{result['bare_copies']['h2d_gbps'] or 0:.1f}")
    return ("pass" if ok else "fail"), summary, result
