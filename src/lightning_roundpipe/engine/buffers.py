"""Buffers a layer writes in forward (BatchNorm's running statistics, ``num_batches_tracked``).

GPipe's semantics: after each forward microbatch the buffers it wrote are copied home, one
update per microbatch in order (exactly the default strategy's with ``microbatches=1``);
recompute updates only the worker's copy. Batch-norm layers are refused with several microbatches
unless ``batch_statistics="per_microbatch"`` (``adapters/batch_statistics.py``); other writers
warn once. Writes are seen by version counters. Details: docs/design.md, design notes,
``engine/buffers.py``.
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
