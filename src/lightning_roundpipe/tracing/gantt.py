"""A Gantt chart PNG of trace records (needs the ``plot`` extra: matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .chrome import queue_rank
from .records import HOST_WORKER, TraceRecord



# Fixed colours for the kinds the engine records; compute kinds are strong and far apart,
# transfers are lighter. Unknown kinds take colours from a spare palette.
KIND_COLOURS = {
    "forward": "#1f77b4",  # blue
    "backward": "#d62728",  # red
    "fused": "#9467bd",  # purple
    "weights": "#aec7e8",
    "act_in": "#98df8a",
    "act_out": "#2ca02c",
    "grad_in": "#ffbb78",
    "grad_out": "#ff7f0e",
    "wgrad": "#c49c94",
    "optim": "#7f7f7f",
}
_SPARE_COLOURS = ("#17becf", "#bcbd22", "#e377c2", "#8c564b", "#dbdb8d", "#9edae5", "#f7b6d2")
# Hatching makes the three compute kinds distinguishable in grey-scale prints too.
KIND_HATCHES = {"backward": "//", "fused": "xx"}


def _colour_of(kind: str, spare: dict[str, str]) -> str:
    if kind in KIND_COLOURS:
        return KIND_COLOURS[kind]
    if kind not in spare:
        spare[kind] = _SPARE_COLOURS[len(spare) % len(_SPARE_COLOURS)]
    return spare[kind]


def save_gantt_png(records: Sequence[TraceRecord], path: str | Path, title: str | None = None) -> None:
    """Draw the records as a Gantt chart PNG at ``path``.

    One row per (worker, queue), workers in index order with their upload, compute and download
    rows, then the host. Bars are coloured by kind (forward, backward and fused compute also
    differ by hatching), wide bars are labelled with their stage, a legend names the kinds and
    the time axis is in milliseconds from the first task. Renders off-screen (Agg), so it works
    without a display and leaves pyplot's global state alone. Needs matplotlib.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "save_gantt_png needs matplotlib; install it with `pip install lightning-roundpipe[plot]`"
        ) from err
    if not records:
        raise ValueError("save_gantt_png got no records to draw; was tracing enabled for the step?")

    origin = min(r.start for r in records)
    span_ms = max((max(r.end for r in records) - origin) * 1e3, 1e-9)
    rows = sorted(
        {(r.worker, r.queue) for r in records},
        key=lambda wq: (wq[0] == HOST_WORKER, wq[0], queue_rank(wq[1]), wq[1]),
    )
    row_of = {row: i for i, row in enumerate(rows)}

    fig = Figure(figsize=(12, 1.0 + 0.38 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    spare: dict[str, str] = {}
    kinds: dict[str, None] = {}
    for r in records:
        kinds.setdefault(r.kind)
        y = row_of[(r.worker, r.queue)]
        left, width = (r.start - origin) * 1e3, (r.end - r.start) * 1e3
        ax.barh(
            y, width, left=left, height=0.8, color=_colour_of(r.kind, spare),
            hatch=KIND_HATCHES.get(r.kind), edgecolor="black", linewidth=0.3,
        )
        # Label only bars wide enough to hold the text.
        if r.stage and width > 0.04 * span_ms:
            ax.text(left + width / 2, y, r.stage, ha="center", va="center", fontsize=7)

    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["host" if w == HOST_WORKER else f"w{w} {q}" for w, q in rows])
    ax.invert_yaxis()  # worker 0 at the top
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, span_ms)
    ax.set_title(title or "RoundPipe timeline")
    # Known kinds in the palette's order (compute first), then the others alphabetically.
    legend_kinds = [k for k in KIND_COLOURS if k in kinds] + sorted(k for k in kinds if k not in KIND_COLOURS)
    handles = [
        Patch(facecolor=_colour_of(k, spare), hatch=KIND_HATCHES.get(k), edgecolor="black", label=k)
        for k in legend_kinds
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=110)
