"""Read-only helpers over a :class:`~lightning_roundpipe.cost.profile.CostProfile` for whole layer ranges.

Per-microbatch bytes and seconds of a stage ``[a, b)``. Where a layer gives no parameter
counts or kept graph, :class:`~lightning_roundpipe.cost.profile.CostProfile` derives them.
"""

from __future__ import annotations

from .profile import CostProfile


class CostView:
    """Sums of a cost profile's per-layer numbers over layer ranges, for one microbatch."""

    def __init__(self, costs: CostProfile) -> None:
        if not costs.layers:
            raise ValueError("the cost profile has no layers")
        self.costs = costs
        self.layers = costs.layers
        self.tokens = int(costs.tokens_per_microbatch)
        self.dtype_bytes = int(costs.dtype_bytes)
        self.graph_per_token = costs.layer_graph_bytes_per_token()
        self.trainable = costs.layer_trainable_params()
        self.params = costs.layer_params()
        self.input_bytes_per_token = int(costs.input_bytes_per_token)
        self._graph_prefix = [0]
        for g in self.graph_per_token:
            self._graph_prefix.append(self._graph_prefix[-1] + g)

    def __len__(self) -> int:
        return len(self.layers)

    # bytes of one microbatch
    def in_bytes(self, layer: int) -> int:
        """Input activation of ``layer`` (the previous layer's output; token ids for layer 0)."""
        per_token = self.layers[layer - 1].act_bytes_per_token if layer > 0 else self.input_bytes_per_token
        return per_token * self.tokens

    def out_bytes(self, layer: int) -> int:
        return self.layers[layer].act_bytes_per_token * self.tokens

    def weights(self, a: int, b: int) -> int:
        return sum(self.layers[i].weight_bytes for i in range(a, b))

    def grads(self, a: int, b: int) -> int:
        return sum(self.layers[i].grad_bytes for i in range(a, b))

    def graph(self, a: int, b: int) -> int:
        """Activations autograd keeps for the backward of the whole range (stage-level recompute)."""
        return (self._graph_prefix[b] - self._graph_prefix[a]) * self.tokens

    def max_layer_graph(self, a: int, b: int) -> int:
        """Largest single-layer working set in the range (forward without a kept graph)."""
        return max(self.graph_per_token[i] for i in range(a, b)) * self.tokens

    def stage_graph(self, kind: str, a: int, b: int) -> int:
        """The activation working set of one microbatch of a stage, the one formula every reader uses.

        A forward runs without autograd, so only the largest layer's intermediates are alive; a
        backward (it recomputes the stage) and a fused stage keep the whole stage's graph.
        """
        return self.max_layer_graph(a, b) if kind == "forward" else self.graph(a, b)

    # seconds of one microbatch
    def forward_s(self, a: int, b: int) -> float:
        return sum(self.layers[i].forward_s for i in range(a, b))

    def backward_with_recompute_s(self, a: int, b: int) -> float:
        return sum(self.layers[i].recompute_s + self.layers[i].backward_s for i in range(a, b))

    def fused_s(self, a: int, b: int) -> float:
        """Forward, loss and backward at once: the graph is kept, so no recompute."""
        return sum(self.layers[i].forward_s + self.layers[i].backward_s for i in range(a, b))

    def total_per_layer(self) -> list[float]:
        """Forward + recompute + backward seconds of each layer: what a bound schedule balances."""
        return [c.forward_s + c.recompute_s + c.backward_s for c in self.layers]

    def unique_params(self) -> int:
        c = self.costs.unique_params
        return int(sum(self.params) if c is None else c)

    def unique_trainable_params(self) -> int:
        c = self.costs.unique_trainable_params
        return int(sum(self.trainable) if c is None else c)
