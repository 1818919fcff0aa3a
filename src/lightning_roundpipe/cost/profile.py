"""Per-layer costs: what the partitioner, the plan report and the simulator reason about.

Times are seconds per microbatch on one worker; bytes are as they travel over the link
(weights in the compute dtype). ``estimate_costs`` fills these from sizes and FLOPs before any
measurement; the engine later replaces times by moving averages of what the workers measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rich.filesize import pick_unit_and_suffix


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


# --------------------------------------------------------------------- stage costs
# The cost of a *stage* (a run of layers in one direction) from the per-layer numbers above,
# with the transfers a stage causes: what the partitioner and the plan report price.

StageKind = str  # "forward", "backward" (recompute + backward) or "fused" (forward + loss + backward)


@dataclass(frozen=True)
class StageCost:
    """What one stage costs on one worker for ``microbatches`` microbatches.

    Transfers go through the host (workers are stateless): a stage uploads its weights (before
    its first microbatch, hidden by prefetch when the worker's previous stage runs long enough),
    uploads each microbatch's input (and, in backward, the output gradient), downloads each
    microbatch's output (in backward, the input gradient) and finally the weight gradients.
    Upload and download use the two directions of the link, so they overlap each other and
    the compute; the stage takes ``seconds = max(compute, upload, download)``.
    """

    kind: StageKind
    start: int
    end: int
    microbatches: int
    microbatch_compute_s: float
    microbatch_upload_s: float  # input (+ output gradient) of one microbatch
    microbatch_download_s: float  # output (or input gradient) of one microbatch
    weight_upload_s: float
    grad_download_s: float
    weight_bytes: int  # weights as the worker holds them (``LayerCost.held_weight_bytes``)
    grad_bytes: int  # weight gradients held on the worker until downloaded (0 in forward)
    activation_bytes: int  # activations of one microbatch held while it runs

    @property
    def compute_s(self) -> float:
        """Compute time of the stage over all its microbatches."""
        return self.microbatches * self.microbatch_compute_s

    @property
    def upload_s(self) -> float:
        """Upload time of the stage: its weights once, its inputs per microbatch."""
        return self.weight_upload_s + self.microbatches * self.microbatch_upload_s

    @property
    def download_s(self) -> float:
        """Download time of the stage: its outputs per microbatch, its weight gradients once."""
        return self.microbatches * self.microbatch_download_s + self.grad_download_s

    @property
    def seconds(self) -> float:
        """Predicted time of the stage: the slowest of compute, upload and download."""
        return max(self.compute_s, self.upload_s, self.download_s)

    @property
    def memory_bytes(self) -> int:
        """Device memory the stage needs while it runs: weights, weight gradients, one microbatch's activations."""
        return self.weight_bytes + self.grad_bytes + self.activation_bytes


class StageCostModel:
    """Stage costs of one ``CostProfile`` for a fixed microbatch count and link speed.

    Prefix sums make every stage cost O(stage length) at most, so a partitioner can price all
    O(layers^2) candidate stages. Activation memory: the stage input plus the working set of
    ``stage_graph`` (the formula the simulator and the memory bound use).

    ``recompute=False`` prices backward without the recompute (the forward graph was kept). With it, a
    backward stage's last layer recomputes less by its ``LayerCost.early_stop_s`` (the engine's
    ``recompute_early_stop``; 0 otherwise), as ``CostView.backward_with_recompute_s`` and the simulator price it.
    ``link_bytes_per_second=None`` means transfers are free.
    """

    def __init__(
        self,
        costs: CostProfile,
        microbatches: int,
        link_bytes_per_second: float | None = None,
        recompute: bool = True,
    ) -> None:
        self.costs = costs
        self.microbatches = int(microbatches)
        self.link = link_bytes_per_second
        self.recompute = recompute
        self.tokens = int(costs.tokens_per_microbatch)

        def prefix(values) -> list[float]:
            out = [0.0]
            for v in values:
                out.append(out[-1] + v)
            return out

        layers = costs.layers
        self._fwd = prefix(c.forward_s for c in layers)
        self._rec = prefix(c.recompute_s for c in layers)
        self._bwd = prefix(c.backward_s for c in layers)
        self._weights = prefix(c.weight_bytes for c in layers)
        self._held = prefix(c.held_weight_bytes for c in layers)
        self._grads = prefix(c.grad_bytes for c in layers)
        self._downloads = prefix(c.grad_download_bytes for c in layers)
        from .view import CostView  # the view reads this module's profile types

        self.view = CostView(costs)

    def _transfer_s(self, num_bytes: float) -> float:
        return 0.0 if not self.link else num_bytes / self.link

    def _act(self, layer: int) -> int:
        """Bytes of one microbatch's output of ``layer`` (0 for the model input, i.e. layer -1)."""
        return 0 if layer < 0 else self.costs.layers[layer].act_bytes_per_token * self.tokens

    def stage(self, kind: StageKind, start: int, end: int) -> StageCost:
        """Cost of the stage of layers ``[start, end)`` of the given kind."""
        if kind not in ("forward", "backward", "fused"):
            raise ValueError(f"unknown stage kind {kind!r}; use 'forward', 'backward' or 'fused'")
        n = len(self.costs.layers)
        if not 0 <= start < end <= n:
            raise ValueError(f"stage [{start}:{end}] is not a non-empty layer range of a {n}-layer model")
        fwd = self._fwd[end] - self._fwd[start]
        rec = self._rec[end] - self._rec[start]
        bwd = self._bwd[end] - self._bwd[start]
        weights = int(self._weights[end] - self._weights[start])
        act_in = self._act(start - 1)
        act_out = self._act(end - 1)
        held = self.view.in_bytes(start) + self.view.stage_graph(kind, start, end)
        if kind == "forward":
            compute, up, down, grads, downloads = fwd, act_in, act_out, 0, 0
        else:
            grads = int(self._grads[end] - self._grads[start])
            downloads = int(self._downloads[end] - self._downloads[start])
            if kind == "fused":
                compute, up, down = fwd + bwd, act_in, act_in  # the loss scalar coming back is negligible
            else:
                # the last layer's recompute stops early where the profile prices it (CostView)
                compute = (rec - self.costs.layers[end - 1].early_stop_s if self.recompute else 0.0) + bwd
                up, down = act_in + act_out, act_in  # saved input + output gradient in, input gradient out
        return StageCost(
            kind=kind,
            start=start,
            end=end,
            microbatches=self.microbatches,
            microbatch_compute_s=compute,
            microbatch_upload_s=self._transfer_s(up),
            microbatch_download_s=self._transfer_s(down),
            weight_upload_s=self._transfer_s(weights),
            grad_download_s=self._transfer_s(downloads),
            weight_bytes=int(self._held[end] - self._held[start]),
            grad_bytes=grads,
            activation_bytes=int(held),
        )


BINARY_UNITS = ["B", "KiB", "MiB", "GiB", "TiB"]
COUNT_UNITS = ["", "K", "M", "G"]


def format_bytes(num_bytes: float) -> str:
    """Human-readable size with binary units, e.g. ``1.50 GiB`` (unit picked by ``rich.filesize``)."""
    unit, suffix = pick_unit_and_suffix(abs(num_bytes), BINARY_UNITS, 1024)
    return f"{int(num_bytes)} B" if unit == 1 else f"{num_bytes / unit:.2f} {suffix}"


def format_count(count: float) -> str:
    """Human-readable count with decimal units, e.g. ``950``, ``12.3K``, ``1.45G`` (three significant
    digits; the unit picked by ``rich.filesize``, one up where rounding would print ``1000``)."""
    unit, suffix = pick_unit_and_suffix(abs(count), COUNT_UNITS, 1000)
    value = count / unit
    if unit > 1 and abs(value) >= 999.5 and suffix != COUNT_UNITS[-1]:
        unit, suffix = unit * 1000, COUNT_UNITS[COUNT_UNITS.index(suffix) + 1]
        value = count / unit
    if unit == 1:
        return f"{int(count)}"
    decimals = 0 if abs(value) >= 99.95 else 1 if abs(value) >= 9.995 else 2
    return f"{value:.{decimals}f}{suffix}"


def format_seconds(seconds: float) -> str:
    """Human-readable duration: ``850 us``, ``12.3 ms`` or ``4.56 s``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"
