"""Tokens/s and peak GPU memory of Qwen3-architecture models on one CUDA GPU.

Randomly initialised ``Qwen3ForCausalLM`` models with the real Qwen3-0.6B and Qwen3-1.7B shapes
(no weights are downloaded), trained for a few steps on random token ids by:

- ``roundpipe``: this project, CUDA backend, 1 worker. The model and its fp32 master weights and
  AdamW state stay in host RAM (the bf16 shadows the uploads read are pinned once); stages run in
  bf16 on the GPU (``compute_dtype``, from pinned bf16 shadows) with recompute; the loss is
  computed inside the last stage; fused AdamW runs on the host layer by layer as gradients
  complete (``runtime.overlap_optimizer``, exact).
- ``plain``: plain PyTorch on the GPU without offload: fp32 weights on the GPU, bf16 autocast,
  fused AdamW on the GPU (the usual "bf16-mixed" recipe; same math as ``roundpipe``).
- ``roundpipe_pkg``: the published ``roundpipe`` package (``pip install roundpipe``), when it is
  importable: its Qwen3 preset, bf16 model, fp32 optimizer copies, ``torch.optim.AdamW`` stepped
  through ``model.step`` (asynchronous by default, as that package recommends). Skipped otherwise.

Each system runs ``warmup`` untimed and ``steps`` timed steps; tokens/s is timed tokens over the
wall time of the timed steps (the GPU synchronised at the end). The forward+backward part and the
optimizer part are timed separately where the system allows. Peak GPU memory is
``torch.cuda.max_memory_allocated`` during the system's run.

Commands (repository root)::

    python -m benchmarks.peers.gpu_bench --json gpu_bench.json               # 0.6B and 1.7B, 2048-token sequences
    python -m benchmarks.peers.gpu_bench --sizes 1.7b --seq-len 4096 --batch 2
    python -m benchmarks.peers.gpu_bench --tiny --device cpu                  # debug: tiny model, CPU workers

Without CUDA (and without ``--device cpu``) it prints a message, writes ``{"skipped": ...}`` to
the JSON path and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.harness import cli, markdown_table, write_json

# Real Qwen3 shapes (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B); "tiny" is for debugging.
QWEN3_SIZES: dict[str, dict] = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}
SYSTEMS = ("roundpipe", "plain", "roundpipe_pkg")
TIME_BUDGET_S = 7 * 60  # stop starting new runs past this, so the whole script stays under 8 minutes

GPU_COLUMNS = [
    ("size", "model", "{}"),
    ("params_m", "params (M)", "{:.0f}"),
    ("system", "system", "{}"),
    ("tokens_per_step", "tokens/step", "{}"),
    ("step_s", "step s", "{:.3f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("fwd_bwd_s", "fwd+bwd s", "{:.3f}"),
    ("optimizer_s", "optimizer s", "{:.3f}"),
    ("peak_gpu_mib", "peak GPU MiB", "{:.0f}"),
    ("status", "status", "{}"),
]


@dataclass
class GpuBenchConfig:
    """What to run: model sizes, batch shape, steps, systems, device.

    seq_len / batch: tokens per sequence and sequences per step; microbatches: RoundPipe's split.
    steps / warmup: timed and untimed steps per system.
    device: "cuda" (the benchmark) or "cpu" (debug: RoundPipe's CPU backend, tiny sizes only).
    pin_host: pin what RoundPipe uploads (its bf16 shadows) once, exactly sized (CUDA only; else pageable).
    rp_policy: RoundPipe's partition policy ("auto" cuts stages from estimated costs, so weight
        uploads of the next stage overlap the running one; "params" gives one stage per worker).
    plain_checkpointing: gradient checkpointing for the plain run (off: the usual baseline).
    """

    sizes: tuple = ("0.6b", "1.7b")
    seq_len: int = 2048
    batch: int = 4
    microbatches: int = 4
    steps: int = 3
    warmup: int = 2
    lr: float = 1e-5
    systems: tuple = SYSTEMS
    device: str = "cuda"
    pin_host: bool = True
    plain_checkpointing: bool = False
    rp_policy: str = "auto"
    seed: int = 0


@dataclass
class GpuRow:
    size: str
    system: str
    params_m: float
    tokens_per_step: int
    step_s: float | None = None
    tokens_per_s: float | None = None
    fwd_bwd_s: float | None = None
    optimizer_s: float | None = None
    peak_gpu_mib: float | None = None
    first_loss: float | None = None
    step_times_s: list = field(default_factory=list)
    status: str = "ok"
    error: str | None = None


# ------------------------------------------------------------------ models and data
def qwen3_config(size: str, seq_len: int):
    """A Qwen3Config with the real shape of ``size`` (random init; nothing is downloaded)."""
    from transformers import Qwen3Config

    if size not in QWEN3_SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(QWEN3_SIZES)}")
    cfg = Qwen3Config(**QWEN3_SIZES[size], rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu",
                      max_position_embeddings=max(40960, seq_len), attention_dropout=0.0, use_cache=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(size: str, seq_len: int, device: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """``Qwen3ForCausalLM`` of ``size`` with its parameters on ``device`` in ``dtype``."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(qwen3_config(size, seq_len))
    return model.to(dtype=dtype)


def build_host_model(size: str, seq_len: int, dtype: torch.dtype, seed: int, init_on_cuda: bool):
    """The model in host RAM; initialised on the GPU when there is one (much faster), then moved."""
    model = build_model(size, seq_len, "cuda" if init_on_cuda else "cpu", dtype, seed)
    if init_on_cuda:
        model = model.to("cpu")
        torch.cuda.empty_cache()
    return model


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def make_tokens(cfg: GpuBenchConfig, vocab: int, device: str) -> torch.Tensor:
    """Random token ids ``(batch, seq_len)``; labels are the ids themselves (HF shifts them)."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randint(0, vocab, (cfg.batch, cfg.seq_len), generator=g).to(device)


# ------------------------------------------------------------------ timing
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _reset_gpu(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gpu_mib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None


def time_steps(step: Callable[[], tuple[float, float, float]], cfg: GpuBenchConfig, device: str) -> dict:
    """Run warm-up and timed steps; ``step`` returns (loss, fwd+bwd seconds, optimizer seconds)."""
    first_loss = None
    for _ in range(cfg.warmup):
        loss, _, _ = step()
        first_loss = loss if first_loss is None else first_loss
    _sync(device)
    times, fb, op = [], [], []
    start = time.perf_counter()
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        loss, a, b = step()
        first_loss = loss if first_loss is None else first_loss
        times.append(time.perf_counter() - t0)
        fb.append(a)
        op.append(b)
    _sync(device)
    total = time.perf_counter() - start
    return {"total_s": total, "times": times, "fwd_bwd": sorted(fb)[len(fb) // 2],
            "optimizer": sorted(op)[len(op) // 2], "first_loss": first_loss}


# ------------------------------------------------------------------ the systems
def run_roundpipe(size: str, cfg: GpuBenchConfig) -> tuple[GpuRow, dict]:
    """This project: host-resident model, one worker, bf16 compute, recompute, overlapped host AdamW."""
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
    from lightning_roundpipe.options import PartitionConfig

    device = cfg.device
    model = build_host_model(size, cfg.seq_len, torch.float32, cfg.seed, init_on_cuda=device == "cuda")
    n = count_params(model)
    ids = make_tokens(cfg, model.config.vocab_size, "cpu")
    options = RuntimeOptions(microbatches=cfg.microbatches, recompute="always",
                             compute_dtype=torch.bfloat16 if device == "cuda" else None,
                             partition=PartitionConfig(policy=cfg.rp_policy),
                             pinned="alloc" if cfg.pin_host else "off")
    _reset_gpu(device)
    runtime = RoundPipeRuntime.attach(model, device, 1, options)
    try:
        # Fused AdamW on the host, stepped layer by layer behind the pipeline (exact): each layer's
        # update starts once its gradient is complete; uploads read bf16 shadows it refreshes.
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
        runtime.overlap_optimizer(opt)  # the runtime pinned the bf16 shadows the uploads read, once, exactly sized

        def step():
            marks = []

            def closure():
                opt.zero_grad(set_to_none=True)
                marks.append(time.perf_counter())
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                marks.append(time.perf_counter())  # gradients are in host .grad once backward returns
                return loss

            loss = opt.step(closure)
            runtime.join()  # this step's updates are done: nothing is left for the next step to absorb
            return float(loss.detach()), marks[1] - marks[0], time.perf_counter() - marks[1]

        timing = time_steps(step, cfg, device)
        extra = {"plan": runtime.engine.plan.to_text(), "peak_weight_bytes": runtime.peak_weight_bytes()}
        metrics = getattr(runtime, "last_metrics", None)
        if metrics:
            extra["last_step_metrics"] = metrics
        return _row(size, f"roundpipe (1 {device.upper()} worker, host AdamW)", n, cfg, timing, _peak_gpu_mib(device)), extra
    finally:
        runtime.detach()


def run_plain(size: str, cfg: GpuBenchConfig) -> tuple[GpuRow, dict]:
    """Plain PyTorch on the device: fp32 weights there, bf16 autocast, AdamW there (fused on CUDA)."""
    device = cfg.device
    _reset_gpu(device)
    model = build_model(size, cfg.seq_len, device, torch.float32, cfg.seed)
    if cfg.plain_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    n = count_params(model)
    ids = make_tokens(cfg, model.config.vocab_size, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=device == "cuda")
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with amp:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        _sync(device)
        return float(loss.detach()), t1 - t0, time.perf_counter() - t1

    try:
        timing = time_steps(step, cfg, device)
        return _row(size, f"plain PyTorch (on {device.upper()}, no offload)", n, cfg, timing, _peak_gpu_mib(device)), {}
    finally:
        del model, opt
        _reset_gpu(device)


def run_roundpipe_pkg(size: str, cfg: GpuBenchConfig) -> tuple[GpuRow, dict]:
    """The published ``roundpipe`` package (raises ImportError when it is not installed)."""
    import roundpipe  # noqa: F401 - ImportError means "skip this row"

    if cfg.device != "cuda":
        raise ImportError("the published roundpipe package runs on GPUs only")
    model = build_host_model(size, cfg.seq_len, torch.bfloat16, cfg.seed, init_on_cuda=True)
    n = count_params(model)
    ids = make_tokens(cfg, model.config.vocab_size, "cpu")
    _reset_gpu("cuda")
    wrapped = roundpipe.wrap_model_to_roundpipe(
        model, use_sequential_preset=True, optim_dtype=torch.float32,
        model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=cfg.microbatches))
    opt = torch.optim.AdamW(wrapped.optim_parameters(), lr=cfg.lr)

    def step():
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = wrapped.forward_backward(input_kwargs={"input_ids": ids, "labels": ids},
                                        loss_fn=lambda outputs, labels: outputs.loss)
        value = float(loss.detach()) / cfg.microbatches  # it returns the sum of the per-microbatch means
        t1 = time.perf_counter()
        wrapped.step(opt.step)  # asynchronous: overlaps the next step (1-step-stale weights)
        return value, t1 - t0, time.perf_counter() - t1

    timing = time_steps(step, cfg, "cuda")
    wrapped.synchronize()
    return _row(size, "published roundpipe package (1 GPU)", n, cfg, timing, _peak_gpu_mib("cuda")), {}


RUNNERS = {"roundpipe": run_roundpipe, "plain": run_plain, "roundpipe_pkg": run_roundpipe_pkg}


def _row(size: str, system: str, params: int, cfg: GpuBenchConfig, timing: dict, peak: float | None) -> GpuRow:
    tokens = cfg.batch * cfg.seq_len
    return GpuRow(size=size, system=system, params_m=params / 1e6, tokens_per_step=tokens,
                  step_s=timing["total_s"] / cfg.steps, tokens_per_s=tokens * cfg.steps / timing["total_s"],
                  fwd_bwd_s=timing["fwd_bwd"], optimizer_s=timing["optimizer"], peak_gpu_mib=peak,
                  first_loss=timing["first_loss"], step_times_s=timing["times"])


# ------------------------------------------------------------------ command line
def parse_args(argv: Sequence[str] | None = None) -> GpuBenchConfig | argparse.Namespace:
    p = cli(__doc__.split("\n\n")[0], json_help="also write the results as JSON", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.6b,1.7b", help="comma-separated: " + ",".join(QWEN3_SIZES))
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ",".join(SYSTEMS))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: debug run of the code paths (with --tiny), RoundPipe on CPU workers")
    p.add_argument("--tiny", action="store_true", help="debug: a tiny Qwen3 (2 layers, width 64), 128-token sequences")
    p.add_argument("--no-pin", action="store_true", help="do not pin RoundPipe's host weights before attaching")
    p.add_argument("--rp-policy", default="auto", choices=("auto", "params", "uniform"),
                   help="RoundPipe's partition policy (default auto)")
    p.add_argument("--plain-checkpointing", action="store_true", help="gradient checkpointing in the plain run")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> GpuBenchConfig:
    sizes = tuple(s.strip().lower() for s in args.sizes.split(",") if s.strip())
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    seq_len = args.seq_len
    if args.tiny:
        sizes, seq_len = ("tiny",), min(seq_len, 128)
    unknown = [s for s in sizes if s not in QWEN3_SIZES] + [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown size(s)/system(s) {unknown}; sizes: {', '.join(QWEN3_SIZES)}; systems: {', '.join(SYSTEMS)}")
    if args.device == "cpu" and sizes != ("tiny",):
        raise SystemExit("--device cpu is a debug mode for --tiny only")
    return GpuBenchConfig(sizes=sizes, seq_len=seq_len, batch=args.batch, microbatches=args.microbatches,
                          steps=args.steps, warmup=args.warmup, systems=systems, device=args.device,
                          pin_host=not args.no_pin, plain_checkpointing=args.plain_checkpointing,
                          rp_policy=args.rp_policy)


def _header(cfg: GpuBenchConfig) -> dict:
    info = {"benchmark": "gpu_bench", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "platform": platform.platform(), "config": asdict(cfg)}
    if cfg.device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return info


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        message = "CUDA is not available: gpu_bench needs one CUDA GPU (use --tiny --device cpu to debug on CPU)"
        print(f"skipped: {message}")
        if args.json:
            write_json(args.json, {**_header(cfg), "skipped": message, "rows": []})
        return 0
    started = time.perf_counter()
    rows, extras = [], {}
    print(f"# gpu_bench on {_header(cfg).get('gpu', cfg.device)}: seq {cfg.seq_len} x batch {cfg.batch}, "
          f"{cfg.microbatches} microbatches, {cfg.warmup}+{cfg.steps} steps", flush=True)
    for size in cfg.sizes:
        for system in cfg.systems:
            tokens = cfg.batch * cfg.seq_len
            if time.perf_counter() - started > TIME_BUDGET_S:
                rows.append(GpuRow(size, system, float("nan"), tokens, status="skipped: time budget"))
                continue
            t0 = time.perf_counter()
            try:
                row, extra = RUNNERS[system](size, cfg)
                extras[f"{size}/{system}"] = extra
            except ImportError as exc:
                row = GpuRow(size, system, float("nan"), tokens, status=f"skipped: {exc}")
            except Exception as exc:  # noqa: BLE001 - one failing system must not hide the others
                row = GpuRow(size, system, float("nan"), tokens, status="error", error=traceback.format_exc())
                print(f"  {size} {system}: {type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                _reset_gpu(cfg.device)
            print(f"  {size:<5} {row.system:<40} {row.status:<8} "
                  f"{'' if row.tokens_per_s is None else f'{row.tokens_per_s:.0f} tokens/s'} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
            rows.append(row)
    print()
    print(markdown_table([asdict(r) for r in rows], GPU_COLUMNS))
    print(f"\ntotal {time.perf_counter() - started:.0f}s")
    if args.json:
        write_json(args.json, {**_header(cfg), "rows": [asdict(r) for r in rows], "extras": extras,
                               "elapsed_s": time.perf_counter() - started})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
