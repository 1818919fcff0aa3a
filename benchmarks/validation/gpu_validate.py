"""The first GPU run in one command: a verdict per check and one JSON file, in under 10 minutes on 1 or 8 GPUs.

    python -m benchmarks.validation.gpu_validate --json gpu_validate.json      # every visible GPU
    python -m benchmarks.validation.gpu_validate --gpus 1 --quick              # one GPU, smaller shapes
    python -m benchmarks.validation.gpu_validate --device cpu --quick          # the CPU self-test (fake streams)
    python -m benchmarks.validation.gpu_validate --dry-run                     # the checks and the JSON's form

Checks, in order (each prints PASS / FAIL / SKIP and a one-line summary; details go to the JSON,
written after every check so a run cut short keeps what it measured):

- ``environment``: GPUs (name, memory, capability), PCIe generation and width (current and
  maximum) and NUMA node per GPU, cores (all and usable), torch's intra- and inter-op threads.
- ``parity_fp32``: an fp32 MLP trained 3 SGD steps on 1 and on N GPUs against the CPU backend
  with as many workers: first-step gradients within 1e-5, weights within 1e-4 of the update.
- ``parity_bf16_qwen3``: a tiny Qwen3 (from a config), bf16 compute, 5 AdamW steps overlapped with
  the pipeline, against the plain model under autocast on one device: losses and weights within bf16 rounding.
- ``dropout_recompute``: dropout masks drawn in recompute equal the forward's, on distinct GPUs and
  with three workers sharing GPU 0 (gradients equal a replay of the per-layer seeds on the plain layers).
- ``jitter_bit_identical``: random stream delays (the race amplifier) leave the weights after 3
  overlapped steps bit-identical to the calm run, exact and ``staleness=1``, distinct and shared GPUs.
- ``device_syncs``: device syncs per step made in the workers' threads, counted through
  ``torch.cuda.set_sync_debug_mode("warn")`` after a warm-up step: must be 0.
- ``throughput``: a Qwen3-1.7B shape and a Llama-3.1-8B-width slice, bf16, overlapped AdamW, at 1
  and N GPUs: tokens/s beside the simulator's prediction for the same plan and workload (at the
  GPU's hardware profile); achieved / simulated >= 0.9.
- ``bandwidth``: bare pinned H2D and D2H per GPU, alone and all GPUs at once, beside the
  pipeline's achieved upload bandwidth and exposed transfer time (from the throughput runs).
- ``memory``: per GPU the allocated and reserved peaks against the plan's bound, allocator retries
  after warm-up (0), pinned bytes, RSS (from the throughput runs).
- ``failures``: a task exception, an out-of-memory and a hang each reported within its timeout
  (+1 s) naming the task, no thread of ours left, and the next step exact.

``--device cpu`` runs every check that needs no GPU on the fake-stream backend (the CUDA protocol
on CPU threads, tiny shapes), and skips the others: the CPU self-test. ``--dry-run`` runs nothing
and writes the report's form with every check skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import random
import resource
import subprocess
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

from benchmarks.harness import cli, write_json

VERDICTS = ("pass", "fail", "skip")
TINY_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256)
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # per lane, after line encoding
THROUGHPUT_RATIO_BOUND = 0.9  # the engine reaches its own model within 10% (DESIGN.md)
MEMORY_BOUND_SLACK = 1.25  # allocated peak against the plan's bound: the allocator's rounding and workspaces


# ---------------------------------------------------------------------------- context


class Ctx:
    """What differs between a GPU run and the fake-stream run on the CPU, and what checks share."""

    def __init__(self, device: str, quick: bool, gpus: int | None):
        self.cuda = device == "cuda"
        self.backend = "cuda" if self.cuda else "fake_cuda"
        self.device_type = "cuda" if self.cuda else "cpu"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.quick = quick
        visible = torch.cuda.device_count() if self.cuda and torch.cuda.is_available() else 0
        self.gpus = (min(gpus, visible) if gpus else visible) if self.cuda else (gpus or 2)
        self.cache: dict = {}  # results one check measures and a later one reads (the throughput runs)

    def indices(self, workers: int, shared: bool = False):
        """Device indices of ``workers`` workers: one GPU each (round-robin over the GPUs), or all on GPU 0."""
        if not self.cuda:
            return None
        return [0] * workers if shared else [i % self.gpus for i in range(workers)]

    def runtime(self, module, workers: int, shared: bool = False, **options):
        """``module`` pipelined over ``workers`` workers of this context's backend."""
        from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

        return RoundPipeRuntime.attach(module, self.backend, workers, RuntimeOptions(**options),
                                       device_indices=self.indices(workers, shared))

    def jitter(self, runtime, amount_s: float) -> None:
        """The race amplifier: random delays in the streams (GPU cycles on CUDA, seconds on the fake)."""
        driver = runtime.pool.driver
        if self.cuda:
            driver.jitter_cycles = int(amount_s * 1.5e9)  # about ``amount_s`` at ~1.5 GHz
        else:
            driver.jitter_s = amount_s

    def sync(self) -> None:
        """Wait for every GPU (nothing on the CPU)."""
        if self.cuda:
            for i in range(self.gpus):
                torch.cuda.synchronize(i)


def ours() -> list[str]:
    """The names of this package's threads still alive."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("roundpipe-"))


def wait_threads_gone(limit_s: float) -> list[str]:
    """Wait up to ``limit_s`` for our threads to end; the names of those left."""
    deadline = time.monotonic() + limit_s
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    return ours()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are 0)."""
    d, n = (a.float() - b.float()).norm().item(), b.float().norm().item()
    return d / n if n else d


# ---------------------------------------------------------------------------- environment


def _sysfs(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _pcie_gen(speed: str | None) -> int | None:
    """PCIe generation from sysfs's link speed ("16.0 GT/s PCIe")."""
    try:
        rate = float(speed.split()[0])
    except (AttributeError, ValueError, IndexError):
        return None
    return {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}.get(rate)


def gpu_link(index: int) -> dict:
    """PCIe generation and width (current and maximum) and the NUMA node of GPU ``index``, from sysfs."""
    props = torch.cuda.get_device_properties(index)
    bus = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    out = dict(pci_bus_id=bus)
    if bus is not None:
        dev = Path("/sys/bus/pci/devices") / bus
        numa = _sysfs(dev / "numa_node")
        out.update(numa_node=int(numa) if numa not in (None, "") else None,
                   pcie_gen_current=_pcie_gen(_sysfs(dev / "current_link_speed")),
                   pcie_gen_max=_pcie_gen(_sysfs(dev / "max_link_speed")),
                   pcie_width_current=_int(_sysfs(dev / "current_link_width")),
                   pcie_width_max=_int(_sysfs(dev / "max_link_width")))
    return out


def _int(text: str | None) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def host_cores() -> dict:
    """Cores (all, usable by this process), NUMA nodes with their CPUs, torch's thread counts."""
    nodes = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        nodes[node.name] = _sysfs(node / "cpulist")
    return dict(cpus=os.cpu_count(), usable_cpus=len(os.sched_getaffinity(0)), numa_nodes=nodes,
                torch_threads=torch.get_num_threads(), torch_interop_threads=torch.get_num_interop_threads())


def check_environment(ctx: Ctx) -> tuple[str, str, dict]:
    info = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                host_memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                cuda_available=torch.cuda.is_available(), **host_cores())
    if ctx.cuda and torch.cuda.is_available():
        info["gpus"] = [dict(index=i, name=torch.cuda.get_device_name(i),
                             memory_bytes=torch.cuda.get_device_properties(i).total_memory,
                             capability=".".join(map(str, torch.cuda.get_device_capability(i))), **gpu_link(i))
                        for i in range(ctx.gpus)]
        try:
            info["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                              timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired) as err:
            info["topology"] = f"nvidia-smi not available: {err}"
    if ctx.cuda and not info.get("gpus"):
        return "fail", "no CUDA device", info
    if not ctx.cuda:
        return "pass", f"CPU only (fake streams), {info['usable_cpus']} usable cores", info
    g = info["gpus"]
    links = ", ".join(f"gen{x.get('pcie_gen_max')}x{x.get('pcie_width_max')}@numa{x.get('numa_node')}" for x in g)
    return "pass", f"{len(g)}x {g[0]['name']}; {links}; {info['usable_cpus']} cores", info


# ---------------------------------------------------------------------------- parity


def _mlp(width: int, depth: int, dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh(), *( [nn.Dropout(dropout)] if dropout else []))
              for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, 8))


def _train_mlp(backend: str, ctx: Ctx, workers: int, steps: int, width: int):
    """First-step gradients and final weights of an fp32 MLP trained with SGD over ``backend``."""
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

    net = _mlp(width, 6)
    indices = ctx.indices(workers) if backend == "cuda" else None
    runtime = RoundPipeRuntime.attach(net, backend, workers, RuntimeOptions(microbatches=4), device_indices=indices)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    first = None
    try:
        for step in range(steps):
            x, y = torch.randn(8, width, generator=g), torch.randn(8, 8, generator=g)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(net(x), y).backward()
            if step == 0:
                first = [p.grad.detach().clone() for p in net.parameters()]
            opt.step()
            runtime.after_optimizer_step()
        return first, [p.detach().clone() for p in net.parameters()]
    finally:
        runtime.detach()


def check_parity_fp32(ctx: Ctx) -> tuple[str, str, dict]:
    width, steps = (256 if ctx.cuda else 16), 3
    init = [p.detach().clone() for p in _mlp(width, 6).parameters()]
    details, ok = {}, True
    for workers in sorted({1, ctx.gpus}):
        g_ref, w_ref = _train_mlp("cpu", ctx, workers, steps, width)
        g, w = _train_mlp(ctx.backend, ctx, workers, steps, width)
        grad_err = max(relative(a, b) for a, b in zip(g, g_ref))
        weight_err = max(relative(a - i, b - i) for a, b, i in zip(w, w_ref, init))
        details[f"{workers}_workers"] = dict(worst_grad_rel_error=grad_err, worst_update_rel_error=weight_err)
        ok = ok and grad_err <= 1e-5 and weight_err <= 1e-4
    summary = "; ".join(f"{k}: grads {v['worst_grad_rel_error']:.1e}, weights {v['worst_update_rel_error']:.1e}"
                        for k, v in details.items())
    return ("pass" if ok else "fail"), summary + " (bounds 1e-5, 1e-4)", details


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(attn_implementation="sdpa", tie_word_embeddings=False, **TINY_QWEN3))


def _qwen3_steps(model, ctx: Ctx, steps: int, device: torch.device, pipelined: bool) -> list[float]:
    """Losses of ``steps`` AdamW steps on ``model`` (pipelined: inputs on the host, optimizer overlapped)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runtime = None
    if pipelined:
        runtime = ctx.runtime(model, max(2, ctx.gpus), microbatches=2, compute_dtype=torch.bfloat16)
        runtime.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(steps):
            ids = torch.randint(0, TINY_QWEN3["vocab_size"], (4, 32), generator=g)
            ids = ids if pipelined else ids.to(device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device_type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if runtime is not None:
            runtime.join()
        return losses
    finally:
        if runtime is not None:
            runtime.detach()


def check_parity_bf16_qwen3(ctx: Ctx) -> tuple[str, str, dict]:
    steps = 5
    ref_model = _tiny_qwen3().to(ctx.device)
    init = {n: p.detach().float().cpu().clone() for n, p in ref_model.named_parameters()}
    ref_losses = _qwen3_steps(ref_model, ctx, steps, ctx.device, pipelined=False)
    ref = {n: p.detach().float().cpu() for n, p in ref_model.named_parameters()}
    model = _tiny_qwen3()
    losses = _qwen3_steps(model, ctx, steps, ctx.device, pipelined=True)
    got = {n: p.detach().float() for n, p in model.named_parameters()}
    loss_err = max(abs(a / b - 1) for a, b in zip(losses, ref_losses))
    worst = max(relative(got[n] - init[n], ref[n] - init[n]) for n in ref)
    # All parameters as one vector: Adam divides by tiny second moments, so a tensor whose gradients
    # are near 0 (a norm's weight) can differ a lot in relative terms while the model does not.
    update_err = relative(torch.cat([(got[n] - init[n]).flatten() for n in ref]),
                          torch.cat([(ref[n] - init[n]).flatten() for n in ref]))
    # bf16: an 8-bit mantissa, and the pipeline casts norms to bf16 where autocast keeps them fp32
    ok = loss_err <= 2e-2 and update_err <= 1e-1
    return ("pass" if ok else "fail"), (f"{steps} overlapped steps: worst loss {loss_err:.1e}, update {update_err:.1e} "
                                        f"(bounds 2e-2, 1e-1; worst tensor {worst:.1e})"), dict(
        losses=losses, reference_losses=ref_losses, worst_loss_rel_error=loss_err, update_rel_error=update_err,
        worst_tensor_update_rel_error=worst)


@contextlib.contextmanager
def reference_seed(device: torch.device, seed: int):
    """The plain layer's call with the generator the engine seeds for it (one thread here, so
    torch's own fork_rng puts the generator back afterwards)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type == "cuda":
            torch.cuda.default_generators[device.index or 0].manual_seed(seed)
        else:
            torch.manual_seed(seed)
        yield


def _dropout_case(ctx: Ctx, workers: int, shared: bool) -> dict:
    from lightning_roundpipe import EngineOptions, PipelineEngine, Plan
    from lightning_roundpipe.engine import layer_seed
    from lightning_roundpipe.workers import make_pool

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.5)) for _ in range(4)]
    x, y = torch.randn(6, 32), torch.randn(6, 32)
    plan = Plan(4, [(0, 3), (3, 4)], [(0, 1), (1, 2), (2, 4)])  # backward cut unlike forward
    pool = make_pool(ctx.backend, workers, device_indices=ctx.indices(workers, shared))
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
    outs = []
    for i, xb in enumerate(torch.tensor_split(x, 3)):
        h = xb.to(ctx.device)
        for k, layer in enumerate(layers):
            layer.zero_grad(set_to_none=True)
            layer.to(h.device)
            with reference_seed(h.device, layer_seed(base, k, i)):
                h = layer(h)
        outs.append(h)
    # The reference runs on one device; on a GPU a mask depends only on the seed and the shape.
    ref_out = torch.cat([o.cpu() for o in outs])
    ((ref_out - y) ** 2).sum().backward()
    ref = [p.grad.cpu() for l in layers for p in l.parameters()]
    for l in layers:
        l.to("cpu")
    out_err = (out.detach() - ref_out.detach()).abs().max().item()
    grad_err = max(relative(g, r) for g, r in zip(grads, ref))
    dropped = (ref_out == 0).float().mean().item()
    return dict(workers=workers, shared_gpu=shared, output_max_abs_error=out_err, worst_grad_rel_error=grad_err,
                dropped_fraction=dropped, ok=out_err <= 1e-5 and grad_err <= 1e-5 and dropped > 0.2)


def check_dropout_recompute(ctx: Ctx) -> tuple[str, str, dict]:
    cases = {"distinct": _dropout_case(ctx, max(2, ctx.gpus), shared=False) if ctx.gpus > 1 or not ctx.cuda else None,
             "shared": _dropout_case(ctx, 3, shared=True)}
    details = {k: v for k, v in cases.items() if v is not None}
    ok = all(v["ok"] for v in details.values())
    summary = "; ".join(f"{k}: grads {v['worst_grad_rel_error']:.1e}, dropped {v['dropped_fraction']:.2f}"
                        for k, v in details.items())
    if "distinct" not in details:
        summary += " (one GPU: no distinct-GPU case)"
    return ("pass" if ok else "fail"), summary, details


def _race_train(ctx: Ctx, workers: int, shared: bool, staleness: int, jitter_s: float, steps: int):
    width = 256 if ctx.cuda else 16
    net = _mlp(width, 6, dropout=0.1)
    runtime = ctx.runtime(net, workers, shared, microbatches=4, seed=5, staleness=staleness)
    if jitter_s:
        ctx.jitter(runtime, jitter_s)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    runtime.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    try:
        torch.manual_seed(3)
        for _ in range(steps):
            # Host tensors: the pipeline's outputs come home, so the loss is computed on the host.
            x, y = torch.randn(8, width, generator=g), torch.randn(8, 8, generator=g)

            def closure():
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(net(x).float(), y)
                loss.backward()
                return loss

            opt.step(closure)
        runtime.join()
        return [p.detach().clone() for p in net.parameters()]
    finally:
        runtime.detach()


def check_jitter_bit_identical(ctx: Ctx) -> tuple[str, str, dict]:
    steps = 3
    details, ok = {}, True
    layouts = [("shared", 3, True)] + ([("distinct", ctx.gpus, False)] if ctx.gpus > 1 or not ctx.cuda else [])
    for name, workers, shared in layouts:
        for staleness in (0, 1):
            calm = _race_train(ctx, workers, shared, staleness, 0.0, steps)
            amplified = _race_train(ctx, workers, shared, staleness, 0.002, steps)
            same = all(torch.equal(a, b) for a, b in zip(calm, amplified))
            details[f"{name}_staleness_{staleness}"] = dict(
                workers=workers, bit_identical=same,
                max_abs_diff=max((a - b).abs().max().item() for a, b in zip(calm, amplified)))
            ok = ok and same
    return ("pass" if ok else "fail"), ", ".join(f"{k} {'same' if v['bit_identical'] else 'DIFFERENT'}"
                                                for k, v in details.items()), details


# ---------------------------------------------------------------------------- device syncs


class SyncWarnings:
    """Warnings of ``torch.cuda.set_sync_debug_mode("warn")``, by the thread that made them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def record(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        if "synchroniz" in text.lower():
            with self._lock:
                self.seen.append((threading.current_thread().name, text.splitlines()[0][:200]))

    def in_workers(self) -> list[tuple[str, str]]:
        """The syncs made in this package's worker threads."""
        return [s for s in self.seen if s[0].startswith("roundpipe-")]


@contextlib.contextmanager
def counting_syncs():
    """Count device syncs while the block runs (the sync debug mode's warnings, every one recorded)."""
    recorder = SyncWarnings()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old_show = warnings.showwarning
        warnings.showwarning = recorder.record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield recorder
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old_show


def check_device_syncs(ctx: Ctx) -> tuple[str, str, dict]:
    model = _tiny_qwen3()
    runtime = ctx.runtime(model, max(2, ctx.gpus), microbatches=4, compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runtime.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    steps = 3
    try:
        def step(padded: bool):
            ids = torch.randint(0, TINY_QWEN3["vocab_size"], (8, 64), generator=g)
            mask = torch.ones_like(ids)
            if padded:
                mask[1, 40:] = 0  # a padded row: the mask path must not sync either
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            opt.step()

        step(True)  # warm-up: planning, first allocations
        runtime.join()
        with counting_syncs() as syncs:
            for i in range(steps):
                step(padded=i % 2 == 0)
            runtime.join()
    finally:
        runtime.detach()
    workers = syncs.in_workers()
    distinct = sorted(set(workers))[:20]
    details = dict(steps=steps, worker_syncs=len(workers), worker_syncs_per_step=len(workers) / steps,
                   all_syncs=len(syncs.seen), distinct_worker_syncs=distinct)
    ok = not workers
    return ("pass" if ok else "fail"), (f"{len(workers) / steps:.1f} device syncs per step in worker threads "
                                        f"({len(syncs.seen) / steps:.1f} in all threads)"), details


# ---------------------------------------------------------------------------- throughput and memory


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
                           sequences: int) -> tuple[float, str]:
    """The simulator's tokens/s for ``plan`` on ``gpus`` GPUs of ``gpu_name``'s hardware profile, with
    ``sequences`` sequences of ``shape.seq`` tokens per step in ``microbatches`` microbatches."""
    from lightning_roundpipe.cost.hardware import load_hardware
    from lightning_roundpipe.cost.machine import override_profile, profile_for_gpu
    from lightning_roundpipe.cost.transformer import get_model_shape, shape_layer_costs
    from lightning_roundpipe.sim import simulate_roundpipe

    profile = profile_for_gpu(gpu_name)
    hw, _ = override_profile(load_hardware(profile), gpus=gpus)
    model_shape = dataclasses.replace(get_model_shape(shape.preset), num_layers=shape.layers)
    costs = shape_layer_costs(model_shape, hw, shape.seq, sequences / microbatches)
    if len(costs.layers) != plan.num_layers:
        raise ValueError(f"the cost profile has {len(costs.layers)} layers, the plan {plan.num_layers}")
    result = simulate_roundpipe(plan, costs, hw, microbatches, num_workers=gpus)
    return sequences * shape.seq / result.step_s, f"{profile} profile, {microbatches} microbatches"


def simulated_tokens_per_s(ctx: Ctx, runtime, shape: Shape, gpus: int, sequences: int) -> tuple[float | None, str]:
    """``predicted_tokens_per_s`` for the plan the runtime runs; None and why when it cannot say
    (the fake streams have no GPU profile)."""
    if not ctx.cuda:
        return None, "fake streams: no GPU profile to simulate"
    try:
        return predicted_tokens_per_s(runtime.planner.plan, runtime.planner.microbatches, shape,
                                      torch.cuda.get_device_name(0), gpus, sequences)
    except Exception as err:  # noqa: BLE001 - the prediction is reported, its absence too
        return None, f"{type(err).__name__}: {err}"[:300]


def _memory_stats(ctx: Ctx) -> list[dict]:
    return [dict(allocated_peak_bytes=torch.cuda.max_memory_allocated(i),
                 reserved_peak_bytes=torch.cuda.max_memory_reserved(i),
                 alloc_retries=torch.cuda.memory_stats(i).get("num_alloc_retries", 0)) for i in range(ctx.gpus)] \
        if ctx.cuda else []


def throughput_run(ctx: Ctx, model, shape: Shape, gpus: int, steps: int) -> dict:
    """Warm-up, then ``steps`` timed steps of ``model`` on ``gpus`` GPUs: speed, transfers, memory."""
    from lightning_roundpipe.cost.memory import roundpipe_gpu_bytes
    from lightning_roundpipe.tracing.metrics import exposed_transfer_seconds
    from lightning_roundpipe.workers.host_memory import host_rss_bytes

    sequences = shape.sequences_per_gpu * gpus
    runtime = ctx.runtime(model, gpus, compute_dtype=torch.bfloat16, trace_steps=1)
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

        step()
        runtime.join()
        ctx.sync()
        if ctx.cuda:
            for i in range(gpus):
                torch.cuda.reset_peak_memory_stats(i)
        retries_before = [m["alloc_retries"] for m in _memory_stats(ctx)]
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
                   host_rss_bytes=host_rss_bytes())
        if runtime.kept_steps:
            records = runtime.trace.records(runtime.kept_steps[-1])
            ups = [r for r in records if r.queue == "upload" and r.kind == "weights" and r.duration > 0]
            out.update(upload_gbps=(sum(r.bytes for r in ups) / sum(r.duration for r in ups) / 1e9) if ups else None,
                       exposed_transfer_s=exposed_transfer_seconds(records))
        stats = _memory_stats(ctx)
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


# ---------------------------------------------------------------------------- failures


class _Armed(nn.Linear):
    """A layer that misbehaves on its first call only (so the next step can be checked)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.armed = True

    def forward(self, x):
        if self.armed:
            self.armed = False
            self.misbehave(x)
        return super().forward(x)


class _Raise(_Armed):
    def misbehave(self, x):
        raise ValueError("injected failure in layer 3")


class _Oom(_Armed):
    def misbehave(self, x):
        torch.empty(1 << 46, device=x.device, dtype=torch.uint8)  # 64 TiB: refused at once


class _Hang(_Armed):
    def misbehave(self, x):
        if x.is_cuda:
            torch.cuda._sleep(int(4 * 1.5e9))  # ~4 s of GPU time: a hung kernel
        else:
            time.sleep(4)  # on the fake stream's executor: the "device" is stuck


def check_failures(ctx: Ctx) -> tuple[str, str, dict]:
    from lightning_roundpipe import EngineOptions, PipelineEngine, PipelineError, simple_plan
    from lightning_roundpipe.workers import make_pool

    details, ok = {}, True
    x = torch.randn(4, 32)
    for name, bad, timeout_s in (("exception", _Raise, 10.0), ("out_of_memory", _Oom, 10.0), ("hang", _Hang, 2.0)):
        torch.manual_seed(0)
        layers = [nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), bad(32, 32)]
        layers[3].armed = False
        with torch.no_grad():
            expected = nn.Sequential(*layers)(x)
        layers[3].armed = True  # it misbehaves on the pipeline's first call only
        workers = max(2, ctx.gpus)
        pool = make_pool(ctx.backend, workers, timeout_s=timeout_s, device_indices=ctx.indices(workers))
        eng = PipelineEngine(layers, pool, simple_plan(4, 2), EngineOptions(microbatches=2))
        t0 = time.monotonic()
        message = ""
        try:
            with torch.no_grad():
                eng(x)
            raised = False
        except PipelineError as err:
            raised, message = True, str(err)
        to_error = time.monotonic() - t0
        ctx.sync()  # a hung kernel ends by itself; the next step must not inherit it
        next_error, same_engine = None, True
        try:
            with torch.no_grad():
                got = eng(x)
        except PipelineError as err:  # a timeout may leave this engine's pool stopped: a new one must work
            same_engine, next_error = False, str(err).splitlines()[0]
            eng.close()
            eng = PipelineEngine(layers, make_pool(ctx.backend, workers, timeout_s=timeout_s,
                                                   device_indices=ctx.indices(workers)),
                                 simple_plan(4, 2), EngineOptions(microbatches=2))
            with torch.no_grad():
                got = eng(x)
        finally:
            eng.close()
        next_err = (got - expected).abs().max().item()
        left = wait_threads_gone(8.0 if name == "hang" else 2.0)
        named = "stage F1" in message and "worker 1" in message
        this_ok = raised and named and to_error <= timeout_s + 1.0 and not left and next_err <= 1e-5
        details[name] = dict(raised=raised, seconds_to_error=to_error, timeout_s=timeout_s, names_the_task=named,
                             threads_left=left, next_step_max_abs_error=next_err, next_step_on_same_engine=same_engine,
                             next_step_first_error=next_error, message=message[:600], ok=this_ok)
        ok = ok and this_ok
    summary = ", ".join(f"{k} {v['seconds_to_error']:.2f}s" + ("" if v["ok"] else " FAILED") for k, v in details.items())
    return ("pass" if ok else "fail"), summary, details


# ---------------------------------------------------------------------------- registry and report


@dataclass(frozen=True)
class Check:
    """One check: its function, whether only a GPU can run it, and what it proves (the help line)."""

    run: Callable[[Ctx], tuple[str, str, dict]]
    gpu_only: bool
    what: str


REGISTRY: dict[str, Check] = {
    "environment": Check(check_environment, False, "GPUs, PCIe gen/width, NUMA node per GPU, cores, threads"),
    "parity_fp32": Check(check_parity_fp32, False, "fp32 against the CPU backend on 1 and N GPUs"),
    "parity_bf16_qwen3": Check(check_parity_bf16_qwen3, False, "tiny Qwen3 bf16, 5 overlapped AdamW steps"),
    "dropout_recompute": Check(check_dropout_recompute, False, "recompute's dropout masks equal the forward's"),
    "jitter_bit_identical": Check(check_jitter_bit_identical, False, "jittered runs bit-identical to calm ones"),
    "device_syncs": Check(check_device_syncs, True, "device syncs per step in worker threads: 0"),
    "throughput": Check(check_throughput, False, "1.7B shape and 8B-width slice at 1 and N GPUs vs the simulator"),
    "bandwidth": Check(check_bandwidth, True, "bare pinned H2D/D2H per GPU, alone and at once, vs the pipeline's"),
    "memory": Check(check_memory, True, "allocated/reserved vs the plan's bound, retries 0, pinned, RSS"),
    "failures": Check(check_failures, False, "exception, OOM, hang: reported in time, no thread left, next step exact"),
}
CHECKS = tuple(REGISTRY)
REPORT_KEYS = ("producer", "started", "device", "gpus", "quick", "checks", "verdict", "seconds")
CHECK_KEYS = ("verdict", "summary", "seconds", "details")


def validate_report(report: dict) -> list[str]:
    """What is wrong with a report's form ([] when nothing): the keys, a verdict per check, the overall verdict."""
    problems = [f"missing key {k!r}" for k in REPORT_KEYS if k not in report]
    for name, check in report.get("checks", {}).items():
        if name not in REGISTRY:
            problems.append(f"unknown check {name!r}")
        problems += [f"check {name!r} misses {k!r}" for k in CHECK_KEYS if k not in check]
        if check.get("verdict") not in VERDICTS:
            problems.append(f"check {name!r} has verdict {check.get('verdict')!r}")
    if report.get("verdict") not in ("pass", "fail"):
        problems.append(f"overall verdict {report.get('verdict')!r}")
    return problems


def parse_args(argv=None):
    """The command line (see the module doc)."""
    ap = cli(__doc__.split("\n")[0], quick="smaller shapes and fewer steps",
             json_help="the report (written after every check)", json_default="gpu_validate.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: the GPUs; cpu: the CPU self-test on fake streams (GPU-only checks skipped)")
    ap.add_argument("--gpus", type=int, default=None, help="how many GPUs to use (default: every visible one)")
    ap.add_argument("--only", nargs="*", choices=CHECKS, default=None, help="run only these checks")
    ap.add_argument("--skip", nargs="*", choices=CHECKS, default=(), help="skip these checks")
    ap.add_argument("--dry-run", action="store_true", help="run nothing: write the report's form, every check skipped")
    args = ap.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        ap.error(f"--gpus must be at least 1, got {args.gpus}")
    return args


def run_check(ctx: Ctx, name: str, dry_run: bool) -> dict:
    """One check's entry of the report; a crash is a failed check, never the end of the run."""
    check = REGISTRY[name]
    t0 = time.perf_counter()
    if dry_run:
        verdict, summary, details = "skip", f"dry run: {check.what}", {}
    elif check.gpu_only and not ctx.cuda:
        verdict, summary, details = "skip", "needs a GPU (CPU self-test)", {}
    elif ctx.cuda and ctx.gpus < 1 and name != "environment":
        verdict, summary, details = "skip", "no CUDA device", {}
    else:
        try:
            verdict, summary, details = check.run(ctx)
        except Exception as err:  # noqa: BLE001 - a check that crashes is a failed check, the others still run
            verdict, summary, details = "fail", f"{type(err).__name__}: {err}"[:300], dict(
                traceback=traceback.format_exc())
    if name == "environment":
        ctx.cache["environment"] = details
    return dict(verdict=verdict, summary=summary, seconds=time.perf_counter() - t0, details=details)


def main(argv=None) -> dict:
    """Run the checks asked for; print a line per check; return (and write) the report."""
    args = parse_args(argv)
    started = time.perf_counter()
    ctx = Ctx(args.device, args.quick, args.gpus)
    report = dict(started=time.strftime("%Y-%m-%dT%H:%M:%S"), device=args.device, gpus=ctx.gpus, quick=args.quick,
                  dry_run=args.dry_run, checks={})
    random.seed(0)
    for name in args.only or CHECKS:
        if name in args.skip:
            continue
        entry = run_check(ctx, name, args.dry_run)
        report["checks"][name] = entry
        print(f"{entry['verdict'].upper():4s} {name:22s} {entry['seconds']:6.1f}s  {entry['summary']}", flush=True)
        write_json(args.json, dict(report, verdict="incomplete", seconds=time.perf_counter() - started))
    verdicts = [c["verdict"] for c in report["checks"].values()]
    report["verdict"] = "fail" if "fail" in verdicts else "pass"
    report["seconds"] = time.perf_counter() - started
    write_json(args.json, report)
    report["producer"] = "benchmarks.validation.gpu_validate"
    print(f"overall: {report['verdict'].upper()} in {report['seconds']:.0f}s  ({args.json})")
    return report


if __name__ == "__main__":
    main()
