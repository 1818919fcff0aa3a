"""Device syncs per step in the workers' threads, through torch's sync debug mode."""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch

from .context import TINY_QWEN3, Ctx
from .parity import tiny_qwen3


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
def counting_syncs(cuda: bool = True):
    """Count device syncs while the block runs (the sync debug mode's warnings, every one recorded); without
    ``cuda`` (the fake driver) nothing can sync, and the recorder stays empty."""
    recorder = SyncWarnings()
    if not cuda:
        yield recorder
        return
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
    model = tiny_qwen3()
    runtime = ctx.runtime(model, max(2, ctx.gpus), microbatches=4, compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runtime.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    steps = 2 if ctx.quick else 3
    try:
        def step(padded: bool):
            ids = torch.randint(0, TINY_QWEN3["vocab_size"], (8, 64), generator=g)
            mask = torch.ones_like(ids)
            if padded:
                mask[1, 40:] = 0  # a padded row: the mask path must not sync either
            opt.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device_type, dtype=torch.bfloat16):
                model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            opt.step()

        # Warm-up: planning, first allocations, and every variant the counted steps run (padded and unpadded
        # masks take other paths and, with compiled layers, other graphs: their first run is not a step's).
        for padded in (True, False):
            step(padded)
        runtime.join()
        with counting_syncs(ctx.cuda) as syncs:
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
    note = "" if ctx.cuda else " (fake driver: the steps ran, no device to sync)"
    return ("pass" if ok else "fail"), (f"{len(workers) / steps:.1f} device syncs per step in worker threads "
                                        f"({len(syncs.seen) / steps:.1f} in all threads){note}"), details
