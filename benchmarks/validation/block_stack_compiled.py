"""Compiled blocks and a compiled model, pipelined: gradient error against the same model unpipelined.

    PYTHONPATH=src python benchmarks/validation/block_stack_compiled.py --backend inductor

The tests run this with backend="aot_eager" (fast); inductor compiles C++ and takes minutes on a small CPU.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..", "tests", d) for d in ("adapters", "")]  # the tests' models

from test_block_stack_models import NanoGPT, token_data  # noqa: E402

from lightning_roundpipe.runtime import RoundPipeRuntime, RuntimeOptions  # noqa: E402


def run(what: str, backend: str) -> tuple[float, float]:
    torch.manual_seed(0)
    model = NanoGPT()
    ref = copy.deepcopy(model)
    if what == "blocks":
        for i in range(len(model.transformer.h)):
            model.transformer.h[i] = torch.compile(model.transformer.h[i], backend=backend)
        call = model
    else:
        call = torch.compile(model, backend=backend)
    idx, targets = token_data()[:6]
    ref(idx, targets)[1].backward()
    t0 = time.perf_counter()
    runtime = RoundPipeRuntime.attach(model, "cpu", 2, RuntimeOptions(microbatches=3, step_metrics=False))
    try:
        call(idx, targets)[1].backward()
    finally:
        runtime.detach()
    err = max(((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(model.parameters(), ref.parameters()))
    return err, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args(argv)
    print("| compiled | backend | gradient error | first step s (compile included) |\n|---|---|---|---|")
    for what in ("blocks", "whole model"):
        err, seconds = run(what, args.backend)
        print(f"| {what} | {args.backend} | {err:.1e} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
