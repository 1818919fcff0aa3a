"""Read-only helpers over a ``CostProfile`` for whole layer ranges.

Per-microbatch bytes and seconds of a stage ``[a, b)``. Where a layer gives no parameter
counts or kept graph, ``CostProfile`` derives them.
"""

from __future__ import annotations

from .layer_costs import CostProfile


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
        self.transient_per_token = [c.backward_transient_bytes_per_token or 0 for c in costs.layers]
        # Per layer: its temporaries without autograd, or None where the profile does not say (then
        # its graph stands for its whole working set, carries included).
        self.forward_transient_per_token = [c.forward_transient_bytes_per_token for c in costs.layers]
        self.grad_per_token = [c.act_bytes_per_token if c.act_grad_bytes_per_token is None
                               else c.act_grad_bytes_per_token for c in costs.layers]
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
        """Bytes of the activation layer ``layer`` passes on, for this view's tokens."""
        return self.layers[layer].act_bytes_per_token * self.tokens

    def out_grad_bytes(self, layer: int) -> int:
        """The gradient of ``layer``'s output that its backward receives (and the layer after it sends)."""
        return self.grad_per_token[layer] * self.tokens

    def weights(self, a: int, b: int) -> int:
        """Weight bytes the worker holds for layers ``[a, b)`` (``LayerCost.held_weight_bytes``)."""
        return sum(self.layers[i].held_weight_bytes for i in range(a, b))

    def uploaded_weights(self, a: int, b: int) -> int:
        """Weight bytes uploaded for layers ``[a, b)`` (over the link)."""
        return sum(self.layers[i].weight_bytes for i in range(a, b))

    def grads(self, a: int, b: int) -> int:
        """Gradient bytes of layers ``[a, b)``."""
        return sum(self.layers[i].grad_bytes for i in range(a, b))

    def downloads(self, a: int, b: int) -> int:
        """Gradient download bytes of layers ``[a, b)`` (``LayerCost.grad_download_bytes``)."""
        return sum(self.layers[i].grad_download_bytes for i in range(a, b))

    def graph(self, a: int, b: int) -> int:
        """Activations autograd keeps for the backward of the whole range (stage-level recompute)."""
        return (self._graph_prefix[b] - self._graph_prefix[a]) * self.tokens

    def max_layer_graph(self, a: int, b: int) -> int:
        """Largest single-layer graph in the range (one layer's graph live, as with per-layer checkpoints)."""
        return max(self.graph_per_token[i] for i in range(a, b)) * self.tokens

    def forward_transient(self, a: int, b: int) -> int:
        """Largest working set of one layer of the range run without autograd (a forward stage):
        its temporaries, plus its input and output carries where they are not the stage's own
        (those are the stage's input and output buffers)."""
        def layer(i: int) -> int:
            temporaries = self.forward_transient_per_token[i]
            if temporaries is None:
                return self.graph_per_token[i] * self.tokens
            return (temporaries * self.tokens + (self.in_bytes(i) if i > a else 0)
                    + (self.out_bytes(i) if i < b - 1 else 0))

        return max(layer(i) for i in range(a, b))

    def backward_working_set(self, a: int, b: int) -> int:
        """Peak activation bytes while the range back-propagates (after its recompute, or in a fused stage).

        The whole graph is alive when backward starts at the last layer; each layer's backward then
        frees what it kept, so while layer ``l`` back-propagates only the graphs of layers ``a..l``
        remain, beside that layer's gradients (``backward_transient_bytes_per_token``).
        """
        return max(self.graph(a, b), max(self.graph(a, l + 1) + self.transient_per_token[l] * self.tokens
                                          for l in range(a, b)))

    def stage_graph(self, kind: str, a: int, b: int) -> int:
        """The activation working set of one microbatch of a stage, the one formula every reader uses.

        A forward runs without autograd, so only one layer's temporaries are alive; a backward (it
        recomputes the stage) and a fused stage keep the whole stage's graph, and back-propagating
        it adds one layer's gradients (``backward_working_set``).
        """
        if kind == "forward":
            return self.forward_transient(a, b)
        return self.backward_working_set(a, b)

    # seconds of one microbatch
    def forward_s(self, a: int, b: int) -> float:
        """Forward time of layers ``[a, b)``."""
        return sum(self.layers[i].forward_s for i in range(a, b))

    def backward_with_recompute_s(self, a: int, b: int) -> float:
        """Recompute plus backward time of layers ``[a, b)``, the last one's recompute stopping early where the
        profile prices it (``LayerCost.early_stop_s``, 0 unless ``recompute_early_stop``)."""
        whole = sum(self.layers[i].recompute_s + self.layers[i].backward_s for i in range(a, b))
        return whole - self.layers[b - 1].early_stop_s

    def early_stop_s(self, a: int, b: int) -> float:
        """Recompute seconds layers ``[a, b)`` skip when each one's recompute stops early (layer grain)."""
        return sum(self.layers[i].early_stop_s for i in range(a, b))

    def fused_s(self, a: int, b: int) -> float:
        """Forward, loss and backward at once: the graph is kept, so no recompute."""
        return sum(self.layers[i].forward_s + self.layers[i].backward_s for i in range(a, b))

    def total_per_layer(self) -> list[float]:
        """Forward + recompute + backward seconds of each layer: what a bound schedule balances."""
        return [c.forward_s + c.recompute_s + c.backward_s for c in self.layers]

    def unique_params(self) -> int:
        """Parameters counted once (tied weights once), as the profile gives them or summed."""
        c = self.costs.unique_params
        return int(sum(self.params) if c is None else c)

    def unique_trainable_params(self) -> int:
        """Trainable parameters counted once, as the profile gives them or summed."""
        c = self.costs.unique_trainable_params
        return int(sum(self.trainable) if c is None else c)
