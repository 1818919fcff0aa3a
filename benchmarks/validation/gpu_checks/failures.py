"""Failures: an exception, an out-of-memory and a hang, each reported in time, and the next step exact."""

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
