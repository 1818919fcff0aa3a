"""The per-layer costs of a pipelined module (``LayerCost``, ``CostProfile``) as plain data.

Below ``profile`` (stage costs) and ``view`` (layer-range sums), which both read them, so that
neither imports the other. Times are seconds per microbatch on one worker; bytes are as they travel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class LayerCost:
    """One layer's costs for one microbatch.

    The last four fields are optional; where a layer leaves them out, readers derive them
    from the bytes above (``CostProfile.dtype_bytes`` per parameter, the output activation as
    the kept graph).
    """

    forward_s: float  # forward of one microbatch
    recompute_s: float  # the forward again inside backward (same as forward_s unless measured otherwise)
    backward_s: float  # the backward proper of one microbatch (about 2x forward), recompute excluded
    weight_bytes: int  # uploaded bytes of the layer's weights and buffers (cost/autocast_cast.py's dtypes)
    grad_bytes: int  # its trainable weights' gradients on the worker and downloaded (0 when frozen)
    act_bytes_per_token: int  # bytes of the layer's output activation per token
    params: int | None = None  # parameter count (weights the host keeps a compute-dtype copy of)
    trainable_params: int | None = None  # parameters the host optimizer updates
    graph_bytes_per_token: int | None = None  # activations autograd keeps for the layer's backward
    active_params: int | None = None  # parameters one token runs through (MoE: top_k of E experts); None: all
    # Working sets beyond the graph (see cost/activations.py): temporaries of a forward without
    # autograd (None: the layer's graph), gradients alive on top of the graph in backward (None: 0),
    # and the gradient of the layer's output (None: act_bytes_per_token; a carry's side data gets none).
    forward_transient_bytes_per_token: int | None = None
    backward_transient_bytes_per_token: int | None = None
    act_grad_bytes_per_token: int | None = None
    # Seconds of ``recompute_s`` the layer skips when a backward stage's recompute stops early at it
    # (``recompute_early_stop``: the work only its output needs, a decoder layer's MLP down projection).
    early_stop_s: float = 0.0
    # Bytes the worker holds for the weights while the layer computes, where more than ``weight_bytes``:
    # under a mixed precision a trainable bf16 upload is an fp32 leaf there, plus autocast's bf16 copy
    # of it (cost/autocast_cast.py). None: ``weight_bytes``.
    device_weight_bytes: int | None = None
    # Bytes of the layer's gradient download, where fewer than ``grad_bytes``: under bf16-mixed the
    # gradient of a bf16 upload is rounded to bf16 on the worker and downloaded so (cost/autocast_cast.py's
    # ``download_dtype``). None: ``grad_bytes``.
    download_grad_bytes: int | None = None

    @property
    def grad_download_bytes(self) -> int:
        """Bytes of the layer's gradient download (``download_grad_bytes`` or ``grad_bytes``)."""
        return self.grad_bytes if self.download_grad_bytes is None else self.download_grad_bytes

    @property
    def held_weight_bytes(self) -> int:
        """Device bytes of the layer's weights while it computes (``device_weight_bytes`` or the upload)."""
        return self.weight_bytes if self.device_weight_bytes is None else self.device_weight_bytes

    def scaled(self, factor: float) -> "LayerCost":
        """The same layer with its compute times multiplied by ``factor``."""
        return dataclasses.replace(self, forward_s=self.forward_s * factor, recompute_s=self.recompute_s * factor,
                                   backward_s=self.backward_s * factor, early_stop_s=self.early_stop_s * factor)


@dataclass
class CostProfile:
    """Costs of every layer of the pipelined module, for a given microbatch shape.

    ``dtype_bytes``: bytes per element of ``weight_bytes`` and ``grad_bytes`` (the compute
    dtype), used to count parameters of layers that do not give ``params`` themselves.
    ``link_bytes_per_second``: the host <-> worker link the estimate assumed (None: free).
    ``input_bytes_per_token``: the model input (token ids) per token. ``unique_params`` and
    ``unique_trainable_params``: totals with parameters shared between layers counted once
    (default: the per-layer sums). ``decoder_layers``: the ``(start, end)`` range of layers that
    are transformer decoder layers (the simulator charges their kernel launches on the host,
    ``HardwareProfile.launch_s``); None when unknown.
    """

    layers: list[LayerCost]
    tokens_per_microbatch: int = 1
    measured: bool = False  # False while the numbers are estimates
    source: str = "estimate"  # where the numbers come from: "estimate", "measured", a model or benchmark name
    dtype_bytes: int = 2
    link_bytes_per_second: float | None = None
    input_bytes_per_token: int = 0
    unique_params: int | None = None
    unique_trainable_params: int | None = None
    decoder_layers: tuple[int, int] | None = None
    # Bytes of the host copy the uploads read, every parameter counted once (None: ``unique_params``
    # x ``dtype_bytes``); less where weights stay packed, e.g. 4-bit (cost/quantization.py).
    host_copy_bytes: int | None = None
    # Kernel launches per decoder layer beyond the profile's per-layer counts, (forward task,
    # backward or fused task): an MoE layer's expert dispatch (cost/moe_loop.py).
    extra_launches_per_decoder_layer: tuple[int, int] = (0, 0)

    def __len__(self) -> int:
        return len(self.layers)

    def layer_params(self) -> list[int]:
        """Parameter count per layer (from the weight bytes where it was not given)."""
        return [c.params if c.params is not None else c.weight_bytes // self.dtype_bytes for c in self.layers]

    def layer_trainable_params(self) -> list[int]:
        """Trainable parameter count per layer (from the gradient bytes where it was not given)."""
        return [c.trainable_params if c.trainable_params is not None else c.grad_bytes // self.dtype_bytes
                for c in self.layers]

    def layer_active_params(self) -> list[int]:
        """Parameters one token runs through, per layer (``layer_params`` where a layer does not say)."""
        return [c.active_params if c.active_params is not None else p for c, p in zip(self.layers, self.layer_params())]

    def layer_graph_bytes_per_token(self) -> list[int]:
        """Bytes of autograd graph each layer keeps per token (its output activation where not given)."""
        return [c.graph_bytes_per_token if c.graph_bytes_per_token is not None else c.act_bytes_per_token
                for c in self.layers]
