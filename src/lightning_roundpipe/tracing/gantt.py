"""A Gantt chart PNG of trace records (needs the ``plot`` extra: matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .chrome import queue_rank
from .records import HOST_WORKER, TraceRecord

# One fixed colour per kind the engine records, from matplotlib's tab10 plus a few far from all
# of them (black, gold, light blue, light green): every pair differs by at least ~65 in RGB
# (0-255), so no two legend entries look alike. Compute is blue / red / purple.
KIND_COLOURS = {
    "forward": "#1f77b4",  # blue
    "backward": "#d62728",  # red
    "fused": "#9467bd",  # purple
    "weights": "#bcbd22",  # olive
    "act_in": "#2ca02c",  # green
    "act_out": "#17becf",  # cyan
    "act_save": "#aec7e8",  # light blue
    "grad_in": "#ff7f0e",  # orange
    "grad_out": "#e377c2",  # pink
    "wgrad": "#8c564b",  # brown
    "loss": "#000000",  # black
    "optim": "#7f7f7f",  # grey
    "allreduce": "#ffdd55",  # gold
    "free_kept": "#98df8a",  # light green
}
# Kinds the map does not know take these in order of appearance.
_SPARE_COLOURS = ("#ff9896", "#393b79", "#dbdb8d", "#9edae5", "#f7b6d2", "#c49c94")
# Hatching makes the three compute kinds distinguishable in grey-scale prints too; a layer-grain
# task ("layer_backward", recompute="layer") has its base kind's colour and dots.
KIND_HATCHES = {"backward": "//", "fused": "xx"}
LAYER_PREFIX = "layer_"
LAYER_HATCH = ".."

MIN_BAR_PX = 3.0  # a bar is drawn at least this wide (a 50 us copy in a 1 s step would be a sliver)
LABEL_PX_PER_CHAR = 5.5  # fontsize 7 at the figure's dpi, with a margin: a bar narrower than its label is not labelled
DPI = 110
FIG_WIDTH_IN = 12.0
STEP_MARKER_GID = "step-marker"  # gid of the vertical line at each step's start (tests find them by it)


def colour_of(kind: str, spare: dict[str, str]) -> str:
    """The fixed colour of ``kind``; a kind outside ``KIND_COLOURS`` gets the next spare one,
    remembered in ``spare`` so it keeps it across the figure."""
    base = kind[len(LAYER_PREFIX):] if kind.startswith(LAYER_PREFIX) else kind
    if base in KIND_COLOURS:
        return KIND_COLOURS[base]
    if kind not in spare:
        spare[kind] = _SPARE_COLOURS[len(spare) % len(_SPARE_COLOURS)]
    return spare[kind]


def hatch_of(kind: str) -> str | None:
    """The hatch pattern a bar of task kind ``kind`` is drawn with (layer-grain recompute, fused), or None."""
    if kind.startswith(LAYER_PREFIX):
        return LAYER_HATCH
    return KIND_HATCHES.get(kind)


def _label(record: TraceRecord) -> str:
    return record.stage if record.microbatch < 0 else f"{record.stage}·{record.microbatch}"


def gantt_figure(records: Sequence[TraceRecord], title: str | None = None):
    """The Gantt chart of ``records`` as a matplotlib ``Figure`` (off-screen, Agg; pyplot untouched).

    One row per (worker, queue), workers in index order with their upload, compute and download
    rows, then the host. Each kind has a fixed colour (``KIND_COLOURS``; compute kinds are
    also hatched). Every bar is at least ``MIN_BAR_PX`` pixels wide, so short transfers
    stay visible (the Chrome trace keeps the exact times). A bar wide enough for its label shows
    its stage and microbatch (``F1·0``: stage F1, microbatch 0). A dashed vertical line marks
    where each training step starts, labelled ``step N`` above the plot. The time axis is in
    milliseconds from the first task.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.transforms import blended_transform_factory
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

    fig = Figure(figsize=(FIG_WIDTH_IN, 1.4 + 0.38 * len(rows)), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    # The axes' width in pixels, once laid out the way the figure is saved, converts pixels to ms.
    fig.subplots_adjust(left=0.105, right=0.87, top=1 - 0.55 / fig.get_figheight(), bottom=0.45 / fig.get_figheight())
    # The x range is the span plus one minimum width, so that a bar at the very end stays inside.
    axes_px = max(2 * MIN_BAR_PX, ax.get_position().width * FIG_WIDTH_IN * DPI)
    min_width = MIN_BAR_PX * span_ms / (axes_px - MIN_BAR_PX)
    ms_per_px = (span_ms + min_width) / axes_px

    spare: dict[str, str] = {}
    kinds: dict[str, None] = {}
    for r in records:
        kinds.setdefault(r.kind)
        y = row_of[(r.worker, r.queue)]
        left, width = (r.start - origin) * 1e3, (r.end - r.start) * 1e3
        ax.barh(y, max(width, min_width), left=left, height=0.8, color=colour_of(r.kind, spare),
                hatch=hatch_of(r.kind), edgecolor="black", linewidth=0.3)
        label = _label(r) if r.stage else ""
        if label and width / ms_per_px >= LABEL_PX_PER_CHAR * len(label) + 4:
            ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=7,
                    bbox=dict(facecolor="white", alpha=0.75, linewidth=0, pad=0.6))

    above = blended_transform_factory(ax.transData, ax.transAxes)  # x in ms, y in axes fractions
    for step in sorted({r.step for r in records}):
        start = (min(r.start for r in records if r.step == step) - origin) * 1e3
        ax.axvline(start, color="black", linestyle="--", linewidth=0.9, zorder=3, gid=STEP_MARKER_GID)
        ax.text(start, 1.005, f"step {step}", transform=above, ha="left", va="bottom", fontsize=8,
                fontweight="bold", gid=STEP_MARKER_GID)

    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["host" if w == HOST_WORKER else f"w{w} {q}" for w, q in rows])
    ax.invert_yaxis()  # worker 0 at the top
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, span_ms + min_width)
    ax.set_title(title or "RoundPipe timeline", pad=16)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    # Known kinds in the palette's order (compute first), then the others alphabetically.
    known = list(KIND_COLOURS)
    legend_kinds = sorted(kinds, key=lambda k: (known.index(k) if k in known else len(known), k))
    handles = [
        Patch(facecolor=colour_of(k, spare), hatch=hatch_of(k), edgecolor="black", label=k) for k in legend_kinds
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def save_gantt_png(records: Sequence[TraceRecord], path: str | Path, title: str | None = None) -> None:
    """Draw the records as a Gantt chart PNG at ``path`` (``gantt_figure``). Needs matplotlib."""
    gantt_figure(records, title).savefig(str(path), format="png", dpi=DPI)
