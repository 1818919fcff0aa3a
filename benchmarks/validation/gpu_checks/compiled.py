"""Compiled layers (``compile_layers=True``): compile seconds, the graphs and recompiles dynamo holds per
(layer class, device, grad mode), and the losses against the eager layers' on the same data."""

from __future__ import annotations

import contextlib
import time

import torch

from .context import TINY_QWEN3, Ctx
from .parity import tiny_qwen3

LOSS_TOL = 2e-2  # bf16 compute: inductor fuses element-wise chains and rounds them once, eager rounds each op


@contextlib.contextmanager
def cpu_compiler(ctx: Ctx):
    """On a GPU, inductor as it is. On the fake driver, inductor's plainest CPU code (scalar loops, no compile
    subprocesses: a cold compile in about half the time on two cores); with ``quick``, dynamo's ``aot_eager``
    backend instead: dynamo traces, guards, caches and counts as on a GPU and AOT autograd splits forward and
    backward, but no code is generated (inductor's cold compiles take ~45 s of a CI run on two cores)."""
    if ctx.cuda:
        yield
        return
    import torch._inductor.config as inductor

    real_compile = torch.compile
    if ctx.quick:
        torch.compile = lambda fn, **kwargs: real_compile(fn, backend="aot_eager", dynamic=kwargs.get("dynamic"))
    try:
        with inductor.patch({"cpp.vec_isa_ok": False, "compile_threads": 1}):
            yield
    finally:
        torch.compile = real_compile


def losses(ctx: Ctx, compile_layers: bool, steps: int, workers: int) -> tuple[list[float], float]:
    """Losses of ``steps`` AdamW steps of the tiny Qwen3 pipelined over ``workers`` workers, and the seconds."""
    model = tiny_qwen3()
    runtime = ctx.runtime(model, workers, microbatches=2, compute_dtype=torch.bfloat16, compile_layers=compile_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    out = []
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            ids = torch.randint(0, TINY_QWEN3["vocab_size"], (4, 32), generator=g)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device_type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            runtime.after_optimizer_step()
            out.append(loss.item())
        return out, time.perf_counter() - t0
    finally:
        runtime.detach()


def check_compiled_layers(ctx: Ctx) -> tuple[str, str, dict]:
    from lightning_roundpipe.engine.compiled_layers import COMPILED_LAYERS
    from lightning_roundpipe.engine.early_stop import EARLY_STOP
    from lightning_roundpipe.host.compile_clock import COMPILE_CLOCK

    steps, workers = (2 if ctx.quick else 3), max(2, ctx.gpus)
    eager, eager_s = losses(ctx, False, steps, workers)
    with cpu_compiler(ctx):
        compiled, compiled_s = losses(ctx, True, steps, workers)
    errors = [abs(a / b - 1) for a, b in zip(compiled, eager)]
    graphs = dict(COMPILED_LAYERS.graphs(), **EARLY_STOP.graphs())
    recompiles = COMPILED_LAYERS.recompiles() + EARLY_STOP.recompiles()
    compile_s = COMPILED_LAYERS.compile_seconds() + sum(s for _, s in EARLY_STOP.compiles)
    details = dict(steps=steps, workers=workers, eager_losses=eager, compiled_losses=compiled, loss_rel_errors=errors,
                   eager_s=eager_s, compiled_s=compiled_s, compile_s=compile_s, graphs=graphs, recompiles=recompiles,
                   dynamo_compile_s=COMPILE_CLOCK.seconds(),  # inside dynamo's compiles (this part's process)
                   first_calls=[dict(what=w, seconds=s) for w, s in COMPILED_LAYERS.compiles + EARLY_STOP.compiles])
    ok = bool(graphs) and max(errors) <= LOSS_TOL
    return ("pass" if ok else "fail"), (f"compile {compile_s:.0f}s over {len(graphs)} compiled callables, "
                                        f"{recompiles} recompiles; worst loss vs eager {max(errors):.1e} "
                                        f"(bound {LOSS_TOL:g})"), details
