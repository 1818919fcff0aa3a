"""Per-layer costs: what the partitioner, the plan report and the simulator reason about.

Times are seconds per microbatch on one worker; bytes are as they travel over the link
(weights in the compute dtype). ``estimate_costs`` fills these from sizes and FLOPs before any
measurement; the engine later replaces times by moving averages of what the workers measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.filesize import pick_unit_and_suffix

from .layer_costs import CostProfile, LayerCost
from .view import CostView


# --------------------------------------------------------------------- stage costs
# The cost of a *stage* (a run of layers in one direction) from the per-layer numbers (layer_costs.py),
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
