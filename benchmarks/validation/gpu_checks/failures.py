"""Failures: an exception, an out-of-memory and a hang, each reported in time, and the next step exact; then a
device-side assert (last: on a GPU it leaves the CUDA context unusable, so no step follows it)."""

from __future__ import annotations

import time

import torch
from torch import nn

from .context import Ctx, wait_threads_gone


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


class _DeviceAssert(_Armed):
    def misbehave(self, x):
        if x.is_cuda:  # an out-of-range gather: the kernel asserts, the error surfaces at the next sync
            x.new_zeros(4)[torch.full((1,), 1 << 20, device=x.device)].sum()
        else:  # the fake driver runs no kernel: the error a device-side assert raises, from the task
            raise RuntimeError("CUDA error: device-side assert triggered (injected on the fake driver)")


def device_assert_case(ctx: Ctx, timeout_s: float = 10.0) -> dict:
    """A device-side assert in layer 3's forward: reported within ``timeout_s`` + 5 s, naming the task, and no
    thread of ours left."""
    from lightning_roundpipe import EngineOptions, PipelineEngine, simple_plan
    from lightning_roundpipe.workers import make_pool

    torch.manual_seed(0)
    layers = [nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), _DeviceAssert(32, 32)]
    workers = max(2, ctx.gpus)
    pool = make_pool(ctx.backend, workers, timeout_s=timeout_s, device_indices=ctx.indices(workers))
    eng = PipelineEngine(layers, pool, simple_plan(4, 2), EngineOptions(microbatches=2))
    t0 = time.monotonic()
    message, raised = "", False
    try:
        with torch.no_grad():
            eng(torch.randn(4, 32))
    except Exception as err:  # noqa: BLE001 - any error counts as reported; whether it names the task is checked
        raised, message = True, f"{type(err).__name__}: {err}"
    to_error = time.monotonic() - t0
    try:
        eng.close()
    except Exception as err:  # noqa: BLE001 - closing after a device error may raise it again
        message += f" | on close: {type(err).__name__}: {str(err)[:200]}"
    left = wait_threads_gone(5.0)
    named = "stage F1" in message and "worker 1" in message
    return dict(raised=raised, seconds_to_error=to_error, timeout_s=timeout_s, names_the_task=named,
                threads_left=left, message=message[:600],
                ok=raised and named and to_error <= timeout_s + 5.0 and not left)


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
    if ctx.device_assert:
        details["device_assert"] = device_assert_case(ctx)
        ok = ok and details["device_assert"]["ok"]
    summary = ", ".join(f"{k} {v['seconds_to_error']:.2f}s" + ("" if v["ok"] else " FAILED") for k, v in details.items())
    return ("pass" if ok else "fail"), summary, details
