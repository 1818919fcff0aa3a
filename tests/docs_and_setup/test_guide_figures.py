"""The user guide's figures: each inline figure (scripts/guide_figures.py) is on its page once and is
what its command makes now, exactly or, for timings measured on this machine, within the stated factor;
the timeline picture is the drawing of the committed trace, and that trace is the default job's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _scripts import load_script

REPO = Path(__file__).resolve().parents[2]


load = load_script


guide = load("guide_figures")
doc_figures = load("doc_figures")
FAST = [f for f in guide.FIGURES if not f.slow]
SLOW = [f for f in guide.FIGURES if f.slow]
INVENTORY_PAGE = REPO / "docs" / "guide_notes.md"


def test_every_figure_is_on_its_page_once_and_the_notes_list_them_all():
    assert len({f.name for f in guide.FIGURES}) == len(guide.FIGURES)
    for fig in guide.FIGURES:
        assert set(fig.on_page()) == set(fig.regex().groupindex), fig.name  # raises unless exactly one match
    assert all(not f.timing or f.slow for f in guide.FIGURES)  # a timing is measured afresh: never in the default run
    assert guide.inventory() in INVENTORY_PAGE.read_text()


def test_a_figure_is_read_from_its_page_and_rewritten_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(guide, "REPO", tmp_path)
    (tmp_path / "page.md").write_text("It took 12 s,\nthen 3 s more.\n")
    fig = guide.GuideFigure("demo", "page.md", r"took (?P<a>[0-9]+) s, then (?P<b>[0-9]+) s", "cmd", dict)
    assert fig.on_page() == {"a": "12", "b": "3"}
    fig.write({"a": "9", "b": "100"})
    assert (tmp_path / "page.md").read_text() == "It took 9 s,\nthen 100 s more.\n"
    (tmp_path / "page.md").write_text("took 1 s, then 2 s; took 3 s, then 4 s")
    with pytest.raises(ValueError, match=r"demo: 2 matches of .* in page.md, expected 1"):
        fig.on_page()


def test_a_timing_is_within_the_factor_times_the_load_either_way():
    assert guide.TIMING_FACTOR == 3.0
    assert guide.within_timing_factor({"s": "10.0", "n": "2,000"}, {"s": "29.9", "n": "700"})
    assert not guide.within_timing_factor({"s": "10.0"}, {"s": "30.5"})
    assert not guide.within_timing_factor({"s": "10.0"}, {"s": "3.2"})
    assert guide.within_timing_factor({"s": "10.0"}, {"s": "59.0"}, load=2.0)
    assert not guide.within_timing_factor({"s": "10.0"}, {"s": "61.0"}, load=2.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fig", FAST, ids=lambda f: f.name)
def test_an_exact_figure_is_what_its_command_makes_now(fig):
    assert not fig.timing
    assert fig.on_page() == fig.produce(), f"stale: python scripts/guide_figures.py --write {fig.name}"


@pytest.mark.slow  # each reruns a measurement: its reason is the figure's `slow` (15 s to 80 s, more under load)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fig", SLOW, ids=lambda f: f.name)
def test_a_slow_figure_is_what_a_fresh_run_makes(fig):
    page, before = fig.on_page(), guide.load_factor()
    now = fig.produce()
    load = max(before, guide.load_factor())
    if fig.timing:
        assert guide.within_timing_factor(page, now, load), (page, now, load)
    else:
        assert page == now, f"stale: python scripts/guide_figures.py --write {fig.name}"


def trace_records():
    from lightning_roundpipe.tracing.timeline import load_chrome_trace

    return load_chrome_trace(str(doc_figures.TIMELINE_TRACE))


def structure(records) -> list[tuple]:
    """What ran, without when: (step, worker, queue, kind, stage, microbatch) of every task, sorted."""
    return sorted((r.step, r.worker, r.queue, r.kind, r.stage, r.microbatch) for r in records)


@pytest.mark.timeout(60)
def test_the_timeline_picture_is_the_drawing_of_the_committed_trace():
    from PIL import Image

    committed = Image.open(doc_figures.TIMELINE_PNG).text["Drawing"]
    _, now = doc_figures.timeline_figure(doc_figures.TIMELINE_TRACE)
    assert now == committed, "stale picture: python scripts/doc_figures.py --timeline"


@pytest.mark.timeout(60)
def test_the_digest_tells_a_changed_drawing_apart(tmp_path):
    records = json.loads(doc_figures.TIMELINE_TRACE.read_text())
    events = records["traceEvents"] if isinstance(records, dict) else records
    longest = max((e for e in events if e.get("ph") == "X"), key=lambda e: e["dur"])  # a bar drawn to scale
    longest["dur"] *= 0.9
    (tmp_path / "moved.json").write_text(json.dumps(records))
    _, committed = doc_figures.timeline_figure(doc_figures.TIMELINE_TRACE)
    assert doc_figures.timeline_figure(tmp_path / "moved.json")[1] != committed


def test_the_timeline_page_describes_the_committed_trace():
    records = trace_records()
    forward = sorted({r.stage for r in records if r.kind == "forward"})
    fused = sorted({r.stage for r in records if r.kind == "fused"})
    page = " ".join((REPO / "docs" / "timeline.md").read_text().split())
    assert sorted({r.step for r in records}) == [1, 2] and "first two steps" in page
    assert len(forward) + len(fused) == 3 and len(fused) == 1 and "3 forward stages, the last fused" in page
    assert sorted({r.microbatch for r in records if r.kind == "forward"}) == [0, 1] and "and 2 microbatches" in page
    assert [r for r in records if r.queue == "optim" or r.kind == "optim"] == [] and "There is no host row" in page


@pytest.mark.slow  # runs the default job with trace=true: about 40 s quiet, minutes under load
@pytest.mark.timeout(900)
def test_the_committed_trace_has_the_tasks_the_default_job_runs_now(tmp_path):
    from lightning_roundpipe.tracing.timeline import load_chrome_trace

    doc_figures.command_output(["examples/finetune.py", "trace=true", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"])
    fresh = load_chrome_trace(str(next(tmp_path.rglob("roundpipe_trace.json"))))
    assert structure(fresh) == structure(trace_records()), "stale trace: python scripts/doc_figures.py --timeline"
