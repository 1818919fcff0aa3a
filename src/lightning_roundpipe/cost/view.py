"""Read-only helpers over a :class:`~lightning_roundpipe.cost.profile.CostProfile` for whole layer ranges.

Per-microbatch bytes and seconds of a stage ``[a, b)``, with fallbacks for profiles that carry
only :class:`~lightning_roundpipe.cost.profile.LayerCost` fields (measured ones): the activation graph
kept for backward is then taken as the layer's output activation, and trainable parameters as
gradient bytes over the compute dtype size.
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
        notes = costs.notes or {}
        self.dtype_bytes = int(notes.get("dtype_bytes", 2))
        graph = notes.get("graph_bytes_per_token")
        self.graph_per_token = list(graph) if graph else [c.act_bytes_per_token for c in self.layers]
        trainable = notes.get("trainable_params")
        self.trainable = list(trainable) if trainable else [c.grad_bytes // self.dtype_bytes for c in self.layers]
        params = notes.get("params")
        self.params = list(params) if params else [c.weight_bytes // self.dtype_bytes for c in self.layers]
        self.input_bytes_per_token = int(notes.get("input_bytes_per_token", 0))
        for name, values in (("graph_bytes_per_token", self.graph_per_token), ("trainable_params", self.trainable),
                             ("params", self.params)):
            if len(values) != len(self.layers):
                raise ValueError(f"cost profile notes[{name!r}] has {len(values)} entries for {len(self.layers)} layers")

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
        return sum(self.graph_per_token[i] for i in range(a, b)) * self.tokens

    def max_layer_graph(self, a: int, b: int) -> int:
        """Largest single-layer working set in the range (forward without a kept graph)."""
        return max(self.graph_per_token[i] for i in range(a, b)) * self.tokens

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
        return int((self.costs.notes or {}).get("unique_params", sum(self.params)))

    def unique_trainable_params(self) -> int:
        return int((self.costs.notes or {}).get("unique_trainable_params", sum(self.trainable)))
