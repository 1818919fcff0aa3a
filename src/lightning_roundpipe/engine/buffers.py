"""Buffers a layer writes in forward (BatchNorm's running statistics, ``num_batches_tracked``).

Semantics (GPipe's): a stage's microbatches run in order on one worker, each updating the
worker's copy of the buffers, and after each forward microbatch the buffers it wrote are
copied home, so the host holds the statistics of microbatch 0, then of 0 and 1, and so on: one
update per microbatch, in microbatch order. With ``microbatches=1`` this is exactly the
default strategy's update. With more, a batch-norm layer also normalises with per-microbatch
statistics, which differs from a single-device run: BatchNorm and InstanceNorm layers are refused
before the call unless ``batch_statistics="per_microbatch"`` accepts it (``adapters/batch_statistics.py``);
any other layer writing its buffers gets a warning once.
Recompute in backward updates only the worker's copy, never the host: the statistics are
updated once per forward. A write is noticed by a buffer's version counter (in-place ops bump
it); a layer whose buffers all change without any bump (a custom kernel) is not noticed.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch

_warned: set[int] = set()
_warn_lock = threading.Lock()


def expect_buffer_writes(module: torch.nn.Module) -> None:
    """The user accepted per-microbatch buffer updates of ``module`` (``batch_statistics``): no warning."""
    with _warn_lock:
        _warned.add(id(module))


@contextlib.contextmanager
def buffer_writes(weights, layer: int, module: torch.nn.Module, microbatches: int, keep: bool):
    """Around one layer call: when ``keep``, copy the buffers the call wrote back to the host."""
    if not keep:
        yield
        return
    entries = [(weights.device[i], weights.host[i]) for _, i in weights.layout[layer]
               if not weights.is_param[i] and weights.device[i] is not None]
    versions = [dev._version for dev, _ in entries]
    yield
    if all(dev._version == v for (dev, _), v in zip(entries, versions)):
        return
    # Some kernels update a buffer without bumping its version (batch norm's running statistics;
    # its num_batches_tracked does bump): once one buffer of the layer moved, all come home.
    written = entries
    with torch.no_grad():
        for dev, host in written:
            if dev is not host:
                host.copy_(dev)
    if microbatches > 1:
        with _warn_lock:
            if id(module) in _warned:
                return
            _warned.add(id(module))
        warnings.warn(
            f"pipelined layer {layer} ({type(module).__name__}) updates its buffers in forward: with "
            f"microbatches={microbatches} they are updated once per microbatch, in microbatch order (GPipe), and "
            "batch statistics are per microbatch, which differs from a single-device run; use microbatches=1 "
            "for the exact result (batch_statistics='per_microbatch' accepts this for BatchNorm and InstanceNorm "
            "layers, which are refused otherwise)", stacklevel=2)
