"""The first GPU run in one command: a verdict per check and one JSON file, in under 10 minutes.

    python -m benchmarks.validation.gpu_validate --json gpu_validate.json          # on a machine with one CUDA GPU
    python -m benchmarks.validation.gpu_validate --device cpu --quick             # the same checks on fake streams

Checks (each prints PASS / FAIL / SKIP with a one-line summary; details go to the JSON):

- ``environment``: torch, CUDA, driver, GPUs (name, memory, capability), peer access, ``nvidia-smi topo -m``.
- ``pytest_gpu``: ``tests/workers/test_gpu.py`` (the CUDA parity tests).
- ``virtual_workers_race``: three workers mapped onto one GPU (``device_indices=[0, 0, 0]``), early
  optimizer steps, exact and ``staleness=1``; the race amplifier puts ``torch.cuda._sleep`` of
  random length before each piece of stream work. Weights must be bit-identical to the run without it.
- ``bf16_hf_parity``: a tiny Qwen3 (built from a config) with bf16 compute, against autocast on the
  plain model on the same device: loss and gradients within bf16 rounding.
- ``dropout_recompute``: dropout masks of the recompute equal the forward's (gradients equal a replay
  of the same per-layer seeds on the plain layers).
- ``throughput``: Qwen3-1.7B shape, bf16, with step metrics on and off: tokens/s, lane busy fraction,
  host CPU seconds per wall second, host-to-device GB/s against a bare pinned copy, peak device
  memory against the plan's bound, pinned bytes.
- ``pinned_policies``: alloc / register / off train to the same weights; pinned bytes; no pageable
  weight upload under alloc and register.
- ``failures``: a task exception, an out-of-memory, a hang with ``timeout=2``: each an error within
  timeout + 1 s naming the task, and no worker thread left.

``--device cpu`` runs every check that does not need a GPU on the fake-stream backend (the CUDA
protocol on CPU threads, tiny shapes): the smoke test in CI. Not yet run on a GPU.
"""

from __future__ import annotations

import contextlib

import os
import platform
import random
import resource
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

from benchmarks.harness import cli, write_json

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ("environment", "pytest_gpu", "virtual_workers_race", "bf16_hf_parity", "dropout_recompute", "throughput",
          "pinned_policies", "failures")
SHAPES = {
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256),
}


class Ctx:
    """What differs between a GPU run and the fake-stream run on the CPU."""

    def __init__(self, device: str, quick: bool):
        self.cuda = device == "cuda"
        self.backend = "cuda" if self.cuda else "fake_cuda"
        self.device_type = "cuda" if self.cuda else "cpu"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.quick = quick

    def runtime(self, module, workers: int, **options):
        from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

        indices = [0] * workers if self.cuda else None
        return RoundPipeRuntime.attach(module, self.backend, workers, RuntimeOptions(**options), device_indices=indices)

    def jitter(self, runtime, amount: float) -> None:
        """The race amplifier: random delays in the streams (GPU cycles on CUDA, seconds on the fake)."""
        driver = runtime.pool.driver
        if self.cuda:
            driver.jitter_cycles = int(amount * 1.5e9)  # about ``amount`` seconds at ~1.5 GHz
        else:
            driver.jitter_s = amount

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def ours() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("roundpipe-"))


def wait_threads_gone(limit_s: float) -> list[str]:
    deadline = time.monotonic() + limit_s
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    return ours()


# ---------------------------------------------------------------------------- checks


def check_environment(ctx: Ctx, args) -> tuple[str, str, dict]:
    info = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                cpus=os.cpu_count(), host_memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        info["gpus"] = [dict(name=torch.cuda.get_device_name(i),
                             memory_bytes=torch.cuda.get_device_properties(i).total_memory,
                             capability=".".join(map(str, torch.cuda.get_device_capability(i)))) for i in range(n)]
        info["peer_access"] = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
        try:
            info["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                              timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired) as err:
            info["topology"] = f"nvidia-smi not available: {err}"
    if ctx.cuda and not torch.cuda.is_available():
        return "fail", "no CUDA device", info
    summary = (f"{len(info.get('gpus', []))} GPU(s): {info['gpus'][0]['name']}" if info.get("gpus")
               else "CPU only (fake streams)")
    return "pass", summary, info


def check_pytest_gpu(ctx: Ctx, args) -> tuple[str, str, dict]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/workers/test_gpu.py"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    tail = (proc.stdout + proc.stderr)[-3000:]
    last = tail.strip().splitlines()[-1] if tail.strip() else ""
    return ("pass" if proc.returncode == 0 else "fail"), last, dict(returncode=proc.returncode, output_tail=tail)


def _race_train(ctx: Ctx, staleness: int, jitter: float, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    width = 256 if ctx.cuda else 16
    net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.1)) for _ in range(6)],
                        nn.Linear(width, 8))
    runtime = ctx.runtime(net, 3, microbatches=4, seed=5, staleness=staleness)
    if jitter:
        ctx.jitter(runtime, jitter)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    runtime.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    try:
        torch.manual_seed(3)
        for _ in range(steps):
            x, y = torch.randn(8, width, generator=g), torch.randn(8, 8, generator=g)

            def closure():
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(net(x.to(ctx.device)).float(), y.to(ctx.device))
                loss.backward()
                return loss

            opt.step(closure)
        runtime.join()
        return [p.detach().clone() for p in net.parameters()]
    finally:
        runtime.detach()


def check_virtual_workers_race(ctx: Ctx, args) -> tuple[str, str, dict]:
    steps = 3 if ctx.quick else 5
    details = {}
    ok = True
    for staleness in (0, 1):
        calm = _race_train(ctx, staleness, 0.0, steps)
        amplified = _race_train(ctx, staleness, 0.002, steps)
        same = all(torch.equal(a, b) for a, b in zip(calm, amplified))
        details[f"staleness_{staleness}"] = dict(
            bit_identical=same, max_abs_diff=max((a - b).abs().max().item() for a, b in zip(calm, amplified)))
        ok = ok and same
    return ("pass" if ok else "fail"), f"3 workers on one device, jittered streams bit-identical: {ok}", details


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(attn_implementation="sdpa", tie_word_embeddings=False, **SHAPES["tiny"]))


def check_bf16_hf_parity(ctx: Ctx, args) -> tuple[str, str, dict]:
    model = _tiny_qwen3().to(ctx.device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPES["tiny"]["vocab_size"], (4, 32), generator=g).to(ctx.device)
    with torch.autocast(ctx.device_type, dtype=torch.bfloat16):
        ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    g_ref = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.to("cpu")
    runtime = ctx.runtime(model, 2, microbatches=2, compute_dtype=torch.bfloat16)
    try:
        with torch.autocast(ctx.device_type, dtype=torch.bfloat16):
            loss = model(input_ids=ids.cpu(), labels=ids.cpu()).loss
        loss.backward()
        got = {n: p.grad.detach().float() for n, p in model.named_parameters()}
    finally:
        runtime.detach()
    loss_err = abs(loss.item() / ref.item() - 1)
    grad_err = max(((got[k] - g_ref[k]).norm() / g_ref[k].norm()).item() for k in g_ref)
    ok = loss_err <= 1e-2 and grad_err <= 5e-2  # bf16: 8-bit mantissa, norms and heads in bf16 here
    return ("pass" if ok else "fail"), f"loss {loss_err:.2e}, worst grad {grad_err:.2e} (bounds 1e-2, 5e-2)", dict(
        loss_rel_error=loss_err, worst_grad_rel_error=grad_err)


@contextlib.contextmanager
def reference_seed(device: torch.device, seed: int):
    """The unpipelined reference's layer call with the generator the engine seeds for it (one thread here,
    so torch's own fork_rng is enough: it puts the generator back afterwards)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type == "cuda":
            torch.cuda.default_generators[device.index or 0].manual_seed(seed)
        else:
            torch.manual_seed(seed)
        yield


def check_dropout_recompute(ctx: Ctx, args) -> tuple[str, str, dict]:
    from lightning_roundpipe import EngineOptions, PipelineEngine, Plan
    from lightning_roundpipe.engine import layer_seed
    from lightning_roundpipe.workers import make_pool

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.5)) for _ in range(4)]
    x, y = torch.randn(6, 32), torch.randn(6, 32)
    plan = Plan(4, [(0, 3), (3, 4)], [(0, 1), (1, 2), (2, 4)])
    pool = make_pool(ctx.backend, 2, device_indices=[0, 0] if ctx.cuda else None)
    eng = PipelineEngine(layers, pool, plan, EngineOptions(microbatches=3))
    try:
        torch.manual_seed(123)
        out = eng(x)
        ((out - y) ** 2).sum().backward()
        grads = [p.grad.clone() for l in layers for p in l.parameters()]
    finally:
        eng.close()
    torch.manual_seed(123)
    base = int(torch.randint(0, 2**62, ()).item())
    for l in layers:
        l.zero_grad(set_to_none=True)
        l.to(ctx.device)
    outs = []
    for i, xb in enumerate(torch.tensor_split(x.to(ctx.device), 3)):
        h = xb
        for k, layer in enumerate(layers):
            with reference_seed(ctx.device, layer_seed(base, k, i)):
                h = layer(h)
        outs.append(h)
    ref_out = torch.cat(outs)
    ((ref_out - y.to(ctx.device)) ** 2).sum().backward()
    ref = [p.grad.cpu() for l in layers for p in l.parameters()]
    out_err = (out.detach() - ref_out.detach().cpu()).abs().max().item()
    grad_err = max(((g - r).norm() / r.norm()).item() for g, r in zip(grads, ref))
    zeros = (ref_out == 0).float().mean().item()
    ok = out_err <= 1e-5 and grad_err <= 1e-5 and zeros > 0.2
    return ("pass" if ok else "fail"), f"output {out_err:.1e}, grads {grad_err:.1e}, dropped {zeros:.2f}", dict(
        output_max_abs_error=out_err, worst_grad_rel_error=grad_err, dropped_fraction=zeros)


def _bare_pinned_copy_gbps(ctx: Ctx) -> float | None:
    if not ctx.cuda:
        return None
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=ctx.device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return 5 * src.numel() / (start.elapsed_time(end) / 1e3) / 1e9


def _throughput_run(ctx: Ctx, shape: str, metrics: bool, steps: int, batch: int, seq: int) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lightning_roundpipe.tracing.timeline import bubble_fraction

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(attn_implementation="sdpa", tie_word_embeddings=True, **SHAPES[shape]))
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    runtime = ctx.runtime(model, 1, microbatches=2, compute_dtype=torch.bfloat16, step_metrics=metrics,
                          trace_steps=1 if metrics else 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=False)
    runtime.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (batch, seq), generator=g)
    try:
        walls, cpu = [], []
        for step in range(steps + 1):
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device_type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            runtime.join()
            ctx.sync()
            r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            if step:  # the first step warms up
                walls.append(t1 - t0)
                cpu.append((r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime))
        out = dict(tokens_per_s=batch * seq * len(walls) / sum(walls), step_s=sum(walls) / len(walls),
                   host_cpu_s_per_wall_s=sum(cpu) / sum(walls), pinned_bytes=getattr(runtime.pool, "pinned_bytes", 0),
                   pageable_weight_upload_bytes=getattr(runtime.pool, "pageable_upload_bytes", 0))
        if metrics and runtime.kept_steps:
            records = runtime.trace.records(runtime.kept_steps[-1])
            span = max(r.end for r in records) - min(r.start for r in records)
            busy = sum(r.duration for r in records if r.queue == "compute")
            ups = [r for r in records if r.queue == "upload" and r.kind == "weights" and r.duration > 0]
            out.update(lane_busy_fraction=busy / span if span else None, bubble_fraction=bubble_fraction(records, 1),
                       h2d_gbps=(sum(r.bytes for r in ups) / sum(r.duration for r in ups) / 1e9) if ups else None)
        if ctx.cuda:
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
            try:
                from lightning_roundpipe.cost.memory import roundpipe_gpu_bytes

                out["plan_bound_bytes"] = max(roundpipe_gpu_bytes(runtime.planner.plan, runtime.planner.costs, 1))
            except Exception as err:  # the planner's names may move; the figure is informative
                out["plan_bound_bytes"] = f"unavailable: {err}"
        return out
    finally:
        runtime.detach()


def check_throughput(ctx: Ctx, args) -> tuple[str, str, dict]:
    shape = "1.7b" if ctx.cuda and not ctx.quick else "tiny"
    batch, seq = (2, 2048) if shape == "1.7b" else (2, 32)
    steps = 3 if shape == "1.7b" else 2
    on = _throughput_run(ctx, shape, True, steps, batch, seq)
    off = _throughput_run(ctx, shape, False, steps, batch, seq)
    bare = _bare_pinned_copy_gbps(ctx)
    details = dict(shape=shape, batch=batch, seq=seq, metrics_on=on, metrics_off=off, bare_pinned_copy_gbps=bare,
                   metrics_cost=off["tokens_per_s"] / on["tokens_per_s"] - 1)
    ok = details["metrics_cost"] <= 0.05 or not ctx.cuda  # step metrics must cost almost nothing
    bound = on.get("plan_bound_bytes")
    if ctx.cuda and isinstance(bound, int):
        ok = ok and on["peak_device_bytes"] <= 1.25 * bound
    summary = (f"{shape}: {off['tokens_per_s']:.0f} tok/s (metrics off), {on['tokens_per_s']:.0f} (on), "
               f"busy {on.get('lane_busy_fraction')}, host {on['host_cpu_s_per_wall_s']:.2f} CPU s/s")
    return ("pass" if ok else "fail"), summary, details


def check_pinned_policies(ctx: Ctx, args) -> tuple[str, str, dict]:
    results, details = [], {}
    for policy in ("alloc", "register", "off"):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)], nn.Linear(64, 8))
        runtime = ctx.runtime(net, 2, microbatches=2, compute_dtype=torch.bfloat16, pinned=policy)
        shadows = runtime.shadows  # bf16 copies the uploads read, pinned per the policy at construction
        pinned = runtime.pool.pinned_bytes
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        try:
            for _ in range(3):
                x, y = torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g)
                opt.zero_grad(set_to_none=True)
                with torch.autocast(ctx.device_type, dtype=torch.bfloat16):
                    out = net(x)
                nn.functional.mse_loss(out.float(), y).backward()
                opt.step()
                runtime.after_optimizer_step()  # refreshes the shadows after a synchronous step
            results.append([p.detach().clone() for p in net.parameters()])
            details[policy] = dict(pinned_bytes=pinned, pageable_weight_upload_bytes=runtime.pool.pageable_upload_bytes,
                                   pinned_bytes_per_parameter=pinned / sum(p.numel() for p in net.parameters()))
        finally:
            runtime.detach()
    same = all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))
    ok = same and all(details[p]["pageable_weight_upload_bytes"] == 0 for p in ("alloc", "register"))
    return ("pass" if ok else "fail"), f"same weights under every policy: {same}", details


class _Raise(nn.Linear):
    def forward(self, x):
        raise ValueError("injected failure in layer 3")


class _Oom(nn.Linear):
    def forward(self, x):
        return super().forward(x) + torch.empty(1 << 46, device=x.device, dtype=torch.uint8)[:1].float()


class _Hang(nn.Linear):
    def forward(self, x):
        if x.is_cuda:
            torch.cuda._sleep(int(20 * 1.5e9))  # ~20 s of GPU time: a hung kernel
        else:
            time.sleep(6)  # on the fake stream's executor: the "device" is stuck
        return super().forward(x)


def check_failures(ctx: Ctx, args) -> tuple[str, str, dict]:
    from lightning_roundpipe import EngineOptions, PipelineEngine, PipelineError, simple_plan
    from lightning_roundpipe.workers import make_pool

    details, ok = {}, True
    for name, bad, timeout_s in (("exception", _Raise, 10.0), ("out_of_memory", _Oom, 10.0), ("hang", _Hang, 2.0)):
        layers = [nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), bad(32, 32)]
        pool = make_pool(ctx.backend, 2, timeout_s=timeout_s, device_indices=[0, 0] if ctx.cuda else None)
        eng = PipelineEngine(layers, pool, simple_plan(4, 2), EngineOptions(microbatches=2))
        t0 = time.monotonic()
        message = ""
        try:
            with torch.no_grad():
                eng(torch.randn(4, 32))
            raised = False
        except PipelineError as err:
            raised, message = True, str(err)
        to_error = time.monotonic() - t0
        eng.close()
        left = wait_threads_gone(8.0 if name == "hang" else 2.0)
        named = "stage F1" in message and "worker 1" in message
        this_ok = raised and named and to_error <= timeout_s + 1.0 and not left
        details[name] = dict(raised=raised, seconds_to_error=to_error, names_the_task=named, threads_left=left,
                             message=message[:600])
        ok = ok and this_ok
        ctx.sync()
    summary = ", ".join(f"{k} {v['seconds_to_error']:.2f}s" for k, v in details.items())
    return ("pass" if ok else "fail"), summary, details


RUNNERS = {name: globals()[f"check_{name}"] for name in CHECKS}


def main(argv=None) -> dict:
    ap = cli(__doc__.split("\n")[0], quick="tiny shapes and fewer steps", json_help="the report (written after every check)",
             json_default="gpu_validate.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--only", nargs="*", choices=CHECKS, default=None)
    ap.add_argument("--skip", nargs="*", choices=CHECKS, default=())
    args = ap.parse_args(argv)
    ctx = Ctx(args.device, args.quick)
    report = dict(started=time.strftime("%Y-%m-%dT%H:%M:%S"), device=args.device, checks={})
    random.seed(0)
    for name in args.only or CHECKS:
        if name in args.skip:
            continue
        t0 = time.perf_counter()
        if ctx.cuda and not torch.cuda.is_available() and name != "environment":
            verdict, summary, details = "skip", "no CUDA device", {}
        else:
            try:
                verdict, summary, details = RUNNERS[name](ctx, args)
            except Exception as err:  # a check that crashes is a failed check, the others still run
                verdict, summary, details = "fail", f"{type(err).__name__}: {err}"[:300], dict(
                    traceback=traceback.format_exc())
        seconds = time.perf_counter() - t0
        report["checks"][name] = dict(verdict=verdict, summary=summary, seconds=seconds, details=details)
        print(f"{verdict.upper():4s} {name:22s} {seconds:6.1f}s  {summary}", flush=True)
        write_json(args.json, report)  # after every check: a run cut short keeps what it measured
    verdicts = [c["verdict"] for c in report["checks"].values()]
    report["verdict"] = "fail" if "fail" in verdicts else "pass"
    write_json(args.json, report)
    print(f"overall: {report['verdict'].upper()}  ({args.json})")
    return report


if __name__ == "__main__":
    main()
