"""The timeline PNG is readable: steps marked, stages labelled, kinds told apart, transfers visible."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("matplotlib")
from matplotlib.colors import to_hex, to_rgb  # noqa: E402

from lightning_roundpipe.tracing.gantt import (KIND_COLOURS, MIN_BAR_PX, STEP_MARKER_GID,  # noqa: E402
                                               colour_of, gantt_figure, save_gantt_png)
from lightning_roundpipe.tracing.records import TraceRecord  # noqa: E402


def rec(worker, queue, kind, start, end, stage="", mb=-1, step=0):
    return TraceRecord(worker, queue, kind, stage, mb, 0, start, end, step)


def two_steps():
    """Two steps of 10 s each; each has one wide forward, one wide backward and a 1 us weights copy."""
    out = []
    for step in (0, 1):
        s = 10.0 * step
        out += [
            rec(0, "upload", "weights", s, s + 1e-6, "F0", step=step),
            rec(0, "compute", "forward", s + 0.5, s + 4.5, "F0", mb=0, step=step),
            rec(1, "compute", "backward", s + 5, s + 9, "B0", mb=0, step=step),
            rec(1, "download", "wgrad", s + 9, s + 9.25, "B0", step=step),
            rec(-1, "host", "optim", s + 9.25, s + 9.5, step=step),
        ]
    return out


def _axes(records):
    return gantt_figure(records, title="t").axes[0]


def _px_width(ax, bar) -> float:
    (x0, _), (x1, _) = ax.transData.transform([(bar.get_x(), 0), (bar.get_x() + bar.get_width(), 0)])
    return x1 - x0


def test_steps_are_marked_with_a_line_and_a_label_at_their_start():
    ax = _axes(two_steps())
    lines = [l for l in ax.lines if l.get_gid() == STEP_MARKER_GID]
    assert [l.get_xdata()[0] for l in lines] == [0.0, 10_000.0]  # ms from the first task
    labels = [t.get_text() for t in ax.texts if t.get_gid() == STEP_MARKER_GID]
    assert labels == ["step 0", "step 1"]


def test_wide_bars_are_labelled_with_stage_and_microbatch_narrow_ones_not():
    ax = _axes(two_steps())
    labels = sorted(t.get_text() for t in ax.texts if t.get_gid() != STEP_MARKER_GID)
    # forward and backward of both steps (4 s of 20 s: wide); the 1 us copy, the 0.25 s wgrad and optim are too narrow
    assert labels == ["B0·0", "B0·0", "F0·0", "F0·0"]


def test_every_kind_has_its_own_clearly_different_colour():
    rgb = {k: to_rgb(c) for k, c in KIND_COLOURS.items()}
    assert len(set(KIND_COLOURS.values())) == len(KIND_COLOURS)
    closest = min(sum((a - b) ** 2 for a, b in zip(rgb[p], rgb[q])) ** 0.5 * 255
                  for p, q in itertools.combinations(rgb, 2))
    assert closest >= 60, closest  # on the 0-255 scale: the old palette had light/dark pairs ~40 apart
    assert colour_of("layer_backward", {}) == KIND_COLOURS["backward"]
    spare: dict[str, str] = {}
    assert colour_of("mystery", spare) == colour_of("mystery", spare) not in KIND_COLOURS.values()


def test_bars_have_the_colour_of_their_kind_and_the_legend_names_each_kind():
    ax = _axes(two_steps())
    colours = {to_hex(p.get_facecolor()) for p in ax.patches}
    assert colours == {KIND_COLOURS[k] for k in ("weights", "forward", "backward", "wgrad", "optim")}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward", "weights", "wgrad", "optim"]


def test_a_one_microsecond_transfer_is_drawn_at_least_the_minimum_width():
    ax = _axes(two_steps())
    widths = [_px_width(ax, p) for p in ax.patches]
    assert min(widths) >= MIN_BAR_PX - 1e-6
    forward = [p for p in ax.patches if to_hex(p.get_facecolor()) == KIND_COLOURS["forward"]]
    assert [p.get_width() for p in forward] == pytest.approx([4000.0, 4000.0])  # wide bars keep their true width


def test_png_is_written(tmp_path):
    out = tmp_path / "t.png"
    save_gantt_png(two_steps(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
