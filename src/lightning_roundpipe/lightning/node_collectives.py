"""Collectives of a strategy with one process per node (RoundPipe drives all of a node's workers
from one process): reductions, barriers and broadcasts over the gloo group, and a sampler with
one replica per node. Without a process group they are the identity, as on one device."""

from __future__ import annotations

import torch
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp


class NodeCollectives:
    """Mixin for a ``ParallelStrategy`` whose ranks are nodes, not devices."""

    def _dist(self) -> bool:
        return self.world_size > 1 and torch.distributed.is_initialized()

    def reduce(self, tensor, group=None, reduce_op: ReduceOp | str | None = "mean"):
        if isinstance(tensor, torch.Tensor) and self._dist():
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        if self._dist():
            torch.distributed.barrier()

    def broadcast(self, obj, src: int = 0):
        if not self._dist():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src)
        return holder[0]

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}  # one replica per node, not per worker
