"""What a strategy with one process per node does across nodes (RoundPipe drives all of a node's
workers from one process): which backward only accumulates (the runtime's gradient all-reduce,
started by the strategy's ``pre_backward``, is skipped then), reductions, barriers and broadcasts
over the gloo group, and a sampler with one replica per node. Without a process group they are the
identity, as on one device."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp


class NodeCollectives:
    """Mixin for a ``ParallelStrategy`` whose ranks are nodes, not devices, and whose ``runtime``
    (a ``RoundPipeRuntime`` or None) syncs gradients (``pre_backward``/``post_backward`` in the strategy)."""

    _accumulating = False  # inside Lightning's block_backward_sync (an accumulation-only step)
    last_bytes_reduced = 0  # gradient bytes all-reduced in the last backward

    @contextmanager
    def block_backward_sync(self):
        """Lightning enters this on accumulation-only steps: nothing is communicated then."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _dist(self) -> bool:
        return self.world_size > 1 and torch.distributed.is_initialized()

    def reduce(self, tensor, group=None, reduce_op: ReduceOp | str | None = "mean"):
        """Reduce a tensor across nodes (``"mean"`` by default); anything else, or one node, as it is."""
        if isinstance(tensor, torch.Tensor) and self._dist():
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        """Wait for every node (nothing on one node)."""
        if self._dist():
            torch.distributed.barrier()

    def broadcast(self, obj, src: int = 0):
        """``obj`` from node ``src`` on every node."""
        if not self._dist():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src)
        return holder[0]

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """One sampler replica per node."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}  # one replica per node, not per worker
