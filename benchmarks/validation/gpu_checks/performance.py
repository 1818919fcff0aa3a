"""Throughput beside the simulator, bare and pipeline bandwidth, memory against the plan."""

from __future__ import annotations

import dataclasses
import resource
import threading
import time
from dataclasses import dataclass

import torch

from .context import TINY_QWEN3, Ctx


PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # per lane, after line encoding
THROUGHPUT_RATIO_BOUND = 0.9  # the engine reaches its own model within 10% (DESIGN.md)
MEMORY_BOUND_SLACK = 1.25  # allocated peak against the plan's bound: the allocator's rounding and workspaces


# ---------------------------------------------------------------------------- throughput


@dataclass(frozen=True)
class Shape:
    """A model to time: its HF config's numbers, the simulator's shape, and the workload."""

    name: str
    family: str  # "qwen3" or "llama"
    config: dict
    preset: str  # the simulator's shape preset it is cut from
    layers: int
    seq: int
    sequences_per_gpu: int


def shapes(ctx: Ctx) -> list[Shape]:
    """The 1.7B shape and the 8B-width slice (tiny stand-ins on the CPU)."""
    if not ctx.cuda:
        return [Shape("tiny-qwen3", "qwen3", dict(TINY_QWEN3), "qwen3-1.7b", TINY_QWEN3["num_hidden_layers"], 32, 2)]
    qwen = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                vocab_size=151936, tie_word_embeddings=True)
    llama = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256, tie_word_embeddings=False)
    seq = 1024 if ctx.quick else 2048
    return [Shape("qwen3-1.7b", "qwen3", qwen, "qwen3-1.7b", 28, seq, 2),
            Shape("llama-3.1-8b-slice", "llama", llama, "llama-3.1-8b", 2 if ctx.quick else 4, seq, 2)]


def _build(shape: Shape):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if shape.family == "qwen3" else (LlamaConfig,
                                                                                                   LlamaForCausalLM)
    torch.manual_seed(0)
    values = {k: v for k, v in shape.config.items() if k != "num_hidden_layers"}
    config = config_class(attn_implementation="sdpa", num_hidden_layers=shape.layers, **values)
    return model_class(config)


def predicted_tokens_per_s(plan, microbatches: int, shape: Shape, gpu_name: str, gpus: int,
                           sequences: int, compiled_layers: bool = False) -> tuple[float, str]:
    """The simulator's tokens/s for ``plan`` on ``gpus`` GPUs of ``gpu_name``'s hardware profile, with
    ``sequences`` sequences of ``shape.seq`` tokens per step in ``microbatches`` microbatches;
    ``compiled_layers``: the layers run through ``torch.compile`` (the CUDA backend's default where
    inductor generates GPU code), priced as ``cost.compiled`` prices them."""
    from lightning_roundpipe.cost.compiled import compiled_launches
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.machine import override_profile, profile_for_gpu
    from lightning_roundpipe.cost.transformer import get_model_shape, shape_layer_costs
    from lightning_roundpipe.sim import simulate_roundpipe

    profile = profile_for_gpu(gpu_name)
    hw, _ = override_profile(load_hardware(profile), gpus=gpus)
    model_shape = dataclasses.replace(get_model_shape(shape.preset), num_layers=shape.layers)
    costs = shape_layer_costs(model_shape, hw, shape.seq, sequences / microbatches, compiled_layers=compiled_layers)
    if len(costs.layers) != plan.num_layers:
        raise ValueError(f"the cost profile has {len(costs.layers)} layers, the plan {plan.num_layers}")
    if compiled_layers:
        hw = compiled_launches(hw)
    result = simulate_roundpipe(plan, costs, hw, microbatches, num_workers=gpus)
    layers = "compiled" if compiled_layers else "eager"
    return sequences * shape.seq / result.step_s, f"{profile} profile, {microbatches} microbatches, {layers} layers"


def simulated_tokens_per_s(ctx: Ctx, runtime, shape: Shape, gpus: int, sequences: int) -> tuple[float | None, str]:
    """``predicted_tokens_per_s`` for the plan the runtime runs; None and why when it cannot say
    (the fake streams have no GPU profile)."""
    if not ctx.cuda:
        return None, "fake streams: no GPU profile to simulate"
    try:
        return predicted_tokens_per_s(runtime.planner.plan, runtime.planner.microbatches, shape,
                                      torch.cuda.get_device_name(0), gpus, sequences,
                                      compiled_layers=runtime.engine.options.compile_layers)
    except Exception as err:  # noqa: BLE001 - the prediction is reported, its absence too
        return None, f"{type(err).__name__}: {err}"[:300]


def _memory_stats(runtime) -> list[dict]:
    """Per worker its allocator's allocated and reserved peaks, retries and OOMs (``device_memory_stats``: CUDA's
    caching allocator, or the fake driver's model of it, with each stream pool's reserved peak)."""
    return runtime.pool.device_memory_stats()


def throughput_run(ctx: Ctx, model, shape: Shape, gpus: int, steps: int) -> dict:
    """Warm-up, then ``steps`` timed steps of ``model`` on ``gpus`` GPUs: speed, transfers, memory."""
    from lightning_roundpipe.cost.memory import roundpipe_gpu_bytes
    from lightning_roundpipe.engine.compiled_layers import COMPILED_LAYERS
    from lightning_roundpipe.tracing.records import exposed_transfer_seconds
    from lightning_roundpipe.host.host_memory import host_rss_bytes

    sequences = shape.sequences_per_gpu * gpus
    runtime = ctx.runtime(model, gpus, compute_dtype=torch.bfloat16, trace_steps=1)
    if not ctx.cuda:
        runtime.pool.model_allocator()  # the fake driver's caching allocator, unlimited: its pools measured
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    runtime.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.config["vocab_size"], (sequences, shape.seq), generator=g)
    try:
        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device_type, dtype=torch.bfloat16):
                model(input_ids=ids, labels=ids).loss.backward()
            opt.step()

        compiled_before = COMPILED_LAYERS.compile_seconds()
        w0 = time.perf_counter()
        step()  # the warm-up: with compiled layers (the CUDA default) the first step compiles them
        runtime.join()
        ctx.sync()
        warmup_s = time.perf_counter() - w0
        runtime.pool.reset_step_peaks()
        retries_before = [m["alloc_retries"] for m in _memory_stats(runtime)]
        walls, cpu = [], []
        for _ in range(steps):
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            step()
            runtime.join()
            ctx.sync()
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            walls.append(time.perf_counter() - t0)
            cpu.append((r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime))
        achieved = sequences * shape.seq * len(walls) / sum(walls)
        simulated, sim_note = simulated_tokens_per_s(ctx, runtime, shape, gpus, sequences)
        out = dict(shape=shape.name, gpus=gpus, sequences=sequences, seq=shape.seq,
                   microbatches=runtime.planner.microbatches, step_s=sum(walls) / len(walls),
                   tokens_per_s=achieved, simulated_tokens_per_s=simulated, simulation=sim_note,
                   achieved_over_simulated=achieved / simulated if simulated else None,
                   host_cpu_s_per_wall_s=sum(cpu) / sum(walls), pinned_bytes=runtime.pool.pinned_host_bytes(),
                   compiled_layers=runtime.engine.options.compile_layers, warmup_step_s=warmup_s,
                   compile_s=COMPILED_LAYERS.compile_seconds() - compiled_before,
                   host_rss_bytes=host_rss_bytes())
        if runtime.kept_steps:
            records = runtime.trace.records(runtime.kept_steps[-1])
            ups = [r for r in records if r.queue == "upload" and r.kind == "weights" and r.duration > 0]
            out.update(upload_gbps=(sum(r.bytes for r in ups) / sum(r.duration for r in ups) / 1e9) if ups else None,
                       exposed_transfer_s=exposed_transfer_seconds(records))
        stats = _memory_stats(runtime)
        try:
            bound = roundpipe_gpu_bytes(runtime.planner.plan, runtime.planner.moving.profile(), gpus,
                                        microbatches=runtime.planner.microbatches)
        except Exception as err:  # noqa: BLE001 - reported: the memory check then fails, not silently passes
            bound = f"unavailable: {type(err).__name__}: {err}"[:300]
        out["memory"] = dict(per_gpu=stats, plan_bound_bytes=bound,
                             alloc_retries_after_warmup=[s["alloc_retries"] - b for s, b in zip(stats, retries_before)])
        return out
    finally:
        runtime.detach()


def throughput_runs(ctx: Ctx) -> list[dict]:
    """Every throughput run (measured once, read by the throughput, bandwidth and memory checks)."""
    if "throughput" not in ctx.cache:
        runs = []
        steps = 1 if ctx.quick else 2
        for shape in shapes(ctx):
            model = _build(shape)
            for gpus in sorted({1, ctx.gpus}):
                try:
                    runs.append(throughput_run(ctx, model, shape, gpus, steps))
                except Exception as err:  # noqa: BLE001 - one failed run does not hide the others
                    runs.append(dict(shape=shape.name, gpus=gpus, error=f"{type(err).__name__}: {err}"[:500]))
            del model
        ctx.cache["throughput"] = runs
    return ctx.cache["throughput"]


def check_throughput(ctx: Ctx) -> tuple[str, str, dict]:
    runs = throughput_runs(ctx)
    ok = all("error" not in r for r in runs)
    if ctx.cuda:
        ok = ok and all((r.get("achieved_over_simulated") or 0) >= THROUGHPUT_RATIO_BOUND for r in runs)
    summary = "; ".join(
        f"{r['shape']} x{r['gpus']}: " + (r["error"][:80] if "error" in r else
                                           f"{r['tokens_per_s']:.0f} tok/s"
                                           + (f" = {r['achieved_over_simulated']:.2f}x simulated"
                                              if r.get("achieved_over_simulated") else " (no simulation)"))
        for r in runs)
    return ("pass" if ok else "fail"), summary, dict(runs=runs, ratio_bound=THROUGHPUT_RATIO_BOUND)


class CopyBench:
    """One GPU's pinned host buffer, device buffer and stream, for timing bare copies."""

    def __init__(self, device: int, nbytes: int):
        self.device, self.nbytes = device, nbytes
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        self.stream = torch.cuda.Stream(device=device)

    def gbps(self, to_device: bool, reps: int) -> float:
        """GB/s of ``reps`` back-to-back copies in one direction (after one untimed copy)."""
        def copy():
            if to_device:
                self.dev.copy_(self.host, non_blocking=True)
            else:
                self.host.copy_(self.dev, non_blocking=True)

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            copy()
            start.record(self.stream)
            for _ in range(reps):
                copy()
            end.record(self.stream)
        end.synchronize()
        return reps * self.nbytes / (start.elapsed_time(end) / 1e3) / 1e9


def bare_bandwidth(ctx: Ctx) -> dict:
    """Pinned H2D and D2H GB/s per GPU alone, and per GPU with all GPUs copying at once."""
    nbytes, reps = (64 << 20, 5) if ctx.quick else (256 << 20, 8)
    benches = [CopyBench(i, nbytes) for i in range(ctx.gpus)]  # allocated before any timing
    alone = {d: {b.device: b.gbps(d == "h2d", reps) for b in benches} for d in ("h2d", "d2h")}
    together = {}
    for direction in ("h2d", "d2h"):
        results: dict[int, float] = {}
        barrier = threading.Barrier(len(benches), timeout=60)

        def run(bench, direction=direction, barrier=barrier, results=results):
            barrier.wait()  # every GPU starts copying at once
            results[bench.device] = bench.gbps(direction == "h2d", reps)

        threads = [threading.Thread(target=run, args=(b,), daemon=True) for b in benches]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        together[direction] = results
    return dict(bytes_per_copy=nbytes, alone_gbps=alone, all_at_once_gbps=together,
                all_at_once_total_gbps={d: sum(v.values()) for d, v in together.items()})


def check_bandwidth(ctx: Ctx) -> tuple[str, str, dict]:
    env = ctx.cache.get("environment", {})
    bare = bare_bandwidth(ctx)
    pipeline = [dict(shape=r["shape"], gpus=r["gpus"], upload_gbps=r.get("upload_gbps"),
                     exposed_transfer_s=r.get("exposed_transfer_s"), step_s=r.get("step_s"))
                for r in throughput_runs(ctx) if "error" not in r]
    ok = True
    links = {g["index"]: g for g in env.get("gpus", [])}
    for i, gbps in bare["alone_gbps"]["h2d"].items():
        link = links.get(i, {})
        gen, width = link.get("pcie_gen_max"), link.get("pcie_width_max")
        if gen in PCIE_LANE_GBPS and width:
            ok = ok and gbps >= 0.5 * PCIE_LANE_GBPS[gen] * width  # at least half the link's rate
    best = max(bare["alone_gbps"]["h2d"].values())
    ok = ok and all((p["upload_gbps"] or 0) >= 0.5 * best for p in pipeline)  # the pipeline uses the link
    summary = (f"H2D alone {min(bare['alone_gbps']['h2d'].values()):.1f}-{best:.1f} GB/s, all at once "
               f"{bare['all_at_once_total_gbps']['h2d']:.1f} GB/s total; pipeline uploads "
               + ", ".join(f"{p['upload_gbps'] or 0:.1f}" for p in pipeline) + " GB/s")
    return ("pass" if ok else "fail"), summary, dict(bare=bare, pipeline=pipeline)


def check_memory(ctx: Ctx) -> tuple[str, str, dict]:
    runs = [r for r in throughput_runs(ctx) if "error" not in r]
    ok, lines = bool(runs), []
    for r in runs:
        mem = r["memory"]
        bound = mem["plan_bound_bytes"]
        peaks = [g["allocated_peak_bytes"] for g in mem["per_gpu"][:r["gpus"]]]
        fits = isinstance(bound, list) and all(p <= MEMORY_BOUND_SLACK * max(bound) for p in peaks)
        no_retries = all(n == 0 for n in mem["alloc_retries_after_warmup"])
        ok = ok and fits and no_retries
        lines.append(f"{r['shape']} x{r['gpus']}: peak {max(peaks) / 2**30:.1f} GiB vs bound "
                     + (f"{max(bound) / 2**30:.1f}" if isinstance(bound, list) else "?")
                     + f" GiB, retries {sum(mem['alloc_retries_after_warmup'])}, pinned {r['pinned_bytes'] / 2**30:.1f}"
                     f" GiB, RSS {r['host_rss_bytes'] / 2**30:.1f} GiB")
    return ("pass" if ok else "fail"), "; ".join(lines) or "no throughput run", dict(
        runs=[dict(shape=r["shape"], gpus=r["gpus"], pinned_bytes=r["pinned_bytes"], host_rss_bytes=r["host_rss_bytes"],
                   **r["memory"]) for r in runs], slack=MEMORY_BOUND_SLACK)
