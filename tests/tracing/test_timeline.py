"""Timeline export and metrics on hand-built records whose answers are known exactly.

All times are binary fractions (multiples of 0.5 s), so sums and the microsecond round trip of
the Chrome trace are exact and the tests can compare with ``==``.
"""

import json
import sys
from pathlib import Path

import pytest

from lightning_roundpipe.tracing.timeline import (
    bubble_fraction,
    exposed_transfer_seconds,
    from_chrome_trace,
    hidden_share,
    main,
    save_gantt_png,
    step_metrics,
    summarize_by_step,
    to_chrome_trace,
)
from lightning_roundpipe.tracing.records import TraceRecord


def rec(worker, queue, kind, start, end, stage="", mb=-1, nbytes=0, step=0):
    return TraceRecord(worker, queue, kind, stage, mb, nbytes, start, end, step)


def two_worker_step(step=0, shift=0.0):
    """Two workers; compute runs from t=0 to t=4.

    worker 0 computes [0, 2] and [2, 4] (busy 4 s); worker 1 computes [1, 3] (busy 2 s).
    Bubble: 1 - 6 / (2 * 4) = 0.25.
    Exposed transfers: worker 0 uploads [-1, 0.5] and [-0.5, 0] (union [-1, 0.5], 1 s before its
    compute) and downloads [3.5, 5] (1 s after); worker 1 uploads [0, 1.5] (1 s before its
    compute) and downloads [3, 3.5] (0.5 s after). Total 3.5 s.
    Host: optim [3, 5] overlaps compute on [3, 4] (1 s of 2), optim [4.5, 5] not at all;
    hidden share of "optim" = 1 / 2.5 = 0.4. A "wgrad" host task [0, 1] is fully hidden.
    """
    s = shift
    return [
        rec(0, "upload", "weights", -1 + s, 0.5 + s, "F0", nbytes=4096, step=step),
        rec(0, "upload", "act_in", -0.5 + s, 0 + s, "F0", mb=0, nbytes=512, step=step),
        rec(0, "compute", "forward", 0 + s, 2 + s, "F0", mb=0, step=step),
        rec(0, "compute", "forward", 2 + s, 4 + s, "F0", mb=1, step=step),
        rec(0, "download", "act_out", 3.5 + s, 5 + s, "F0", mb=1, nbytes=512, step=step),
        rec(1, "upload", "weights", 0 + s, 1.5 + s, "B1", nbytes=8192, step=step),
        rec(1, "compute", "backward", 1 + s, 3 + s, "B1", mb=0, step=step),
        rec(1, "download", "wgrad", 3 + s, 3.5 + s, "B1", nbytes=8192, step=step),
        rec(-1, "host", "optim", 3 + s, 5 + s, step=step),
        rec(-1, "host", "optim", 4.5 + s, 5 + s, step=step),
        rec(-1, "host", "wgrad", 0 + s, 1 + s, step=step),
    ]


# ---------------------------------------------------------------------------- metrics


def test_bubble_fraction_is_idle_share_of_compute_queues():
    records = two_worker_step()
    assert bubble_fraction(records) == 0.25
    # A third worker that never computed is fully idle: 1 - 6 / (3 * 4).
    assert bubble_fraction(records, num_workers=3) == 0.5
    with pytest.raises(ValueError, match="num_workers=1 but compute tasks ran on 2 workers"):
        bubble_fraction(records, num_workers=1)


def test_bubble_fraction_edge_cases():
    assert bubble_fraction([]) == 0.0
    # One fully busy worker, with back-to-back and overlapping tasks counted once.
    busy = [rec(0, "compute", "forward", 0, 2), rec(0, "compute", "forward", 1, 3), rec(0, "compute", "fused", 3, 4)]
    assert bubble_fraction(busy) == 0.0


def test_exposed_transfer_seconds_per_worker_interval_arithmetic():
    assert exposed_transfer_seconds(two_worker_step()) == 3.5
    # A transfer on worker 1 is not hidden by worker 0's compute.
    records = [rec(0, "compute", "forward", 0, 2), rec(1, "upload", "weights", 0, 2)]
    assert exposed_transfer_seconds(records) == 2.0
    # Transfers under the same worker's compute are hidden; a gap in compute exposes them.
    records = [
        rec(0, "compute", "forward", 0, 1),
        rec(0, "compute", "forward", 1.5, 3),
        rec(0, "upload", "weights", 0.5, 2.5),
        rec(0, "download", "act_out", 0.5, 2.5),  # overlaps the upload: counted once
    ]
    assert exposed_transfer_seconds(records) == 0.5


def test_hidden_share_of_host_tasks():
    records = two_worker_step()
    assert hidden_share(records) == 0.4
    assert hidden_share(records, kind="wgrad") == 1.0
    assert hidden_share(records, kind="nothing") == 0.0


def test_step_metrics_and_summary_by_step():
    records = two_worker_step()
    metrics = step_metrics(records, tokens=1200)
    assert metrics == {
        "bubble_fraction": 0.25,
        "exposed_transfer_s": 3.5,
        "optim_hidden_share": 0.4,
        "step_s": 6.0,  # from -1 to 5
        "compile_s": 0.0,
        "tokens": 1200,
        "tokens_per_s": 200.0,
    }
    assert step_metrics(records, tokens=None)["tokens_per_s"] is None
    # seconds spent compiling during the step are not the step's: 6 s of span, 2 of them compiling
    compiling = step_metrics(records, tokens=1200, compile_s=2.0)
    assert (compiling["step_s"], compiling["compile_s"], compiling["tokens_per_s"]) == (4.0, 2.0, 300.0)

    two_steps = records + two_worker_step(step=1, shift=8.0)
    summary = summarize_by_step(two_steps, tokens={0: 1200, 1: 600})
    assert list(summary) == [0, 1]
    assert summary[0] == metrics
    assert summary[1] == {**metrics, "tokens": 600, "tokens_per_s": 100.0}
    assert summarize_by_step(two_steps)[1]["tokens_per_s"] is None


# ----------------------------------------------------------------------- chrome trace


def test_chrome_trace_events_and_round_trip(tmp_path):
    records = two_worker_step() + two_worker_step(step=1, shift=8.0)
    path = tmp_path / "trace.json"
    trace = json.loads(json.dumps(to_chrome_trace(records, path)))
    assert json.loads(path.read_text()) == trace

    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(records)
    for event, r in zip(complete, records):
        assert event["ts"] == r.start * 1e6
        assert event["dur"] == (r.end - r.start) * 1e6
        assert event["pid"] == (2 if r.worker == -1 else r.worker)  # host after the two workers
        assert event["args"]["bytes"] == r.bytes and event["args"]["step"] == r.step
    assert complete[3]["name"] == "F0 mb1 forward"
    assert complete[0]["name"] == "F0 weights"
    assert complete[8]["name"] == "optim"
    assert complete[3]["args"] == {
        "worker": 0, "queue": "compute", "kind": "forward", "stage": "F0", "microbatch": 1, "bytes": 0, "step": 0,
    }

    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    process_names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert process_names == {0: "worker 0", 1: "worker 1", 2: "host"}
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert thread_names == {
        (0, 0): "upload", (0, 1): "compute", (0, 2): "download",
        (1, 0): "upload", (1, 1): "compute", (1, 2): "download",
        (2, 3): "host",
    }

    assert from_chrome_trace(trace) == records
    assert from_chrome_trace(trace["traceEvents"]) == records


def test_round_trip_of_arbitrary_times_is_float_close():
    records = [rec(0, "compute", "fused", 0.1234567891, 0.3000000007, "F3", mb=2)]
    back = from_chrome_trace(json.loads(json.dumps(to_chrome_trace(records))))
    assert back[0].start == pytest.approx(records[0].start, rel=1e-12)
    assert back[0].end == pytest.approx(records[0].end, rel=1e-12)
    assert back[0].stage == "F3" and back[0].kind == "fused" and back[0].microbatch == 2


def test_from_chrome_trace_rejects_foreign_events():
    foreign = {"traceEvents": [{"ph": "X", "name": "matmul", "pid": 1, "tid": 1, "ts": 0, "dur": 5}]}
    with pytest.raises(ValueError, match=r"trace event 0 \('matmul'\) lacks args \['worker'"):
        from_chrome_trace(foreign)


# ------------------------------------------------------------------------------- png


def _assert_png(path: Path):
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_gantt_png_writes_a_png(tmp_path):
    records = two_worker_step() + [rec(1, "compute", "fused", 4, 4.5, "F1", mb=0), rec(0, "upload", "custom", 4, 5)]
    out = tmp_path / "gantt.png"
    save_gantt_png(records, out, title="two workers")
    _assert_png(out)
    with pytest.raises(ValueError, match="no records to draw"):
        save_gantt_png([], tmp_path / "empty.png")


def test_missing_matplotlib_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"pip install lightning-roundpipe\[plot\]"):
        save_gantt_png(two_worker_step(), tmp_path / "x.png")


def test_cli_reads_trace_prints_metrics_and_draws(tmp_path, capsys):
    trace_path, png_path = tmp_path / "trace.json", tmp_path / "out.png"
    to_chrome_trace(two_worker_step() + two_worker_step(step=1, shift=8.0), trace_path)
    assert main([str(trace_path), "--png", str(png_path), "--tokens", "1200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "step 0: 6000.000 ms, bubble 25.0%, exposed transfers 3500.000 ms, optimizer hidden 40.0%, 200.0 tokens/s"
    )
    assert lines[1].startswith("step 1: 6000.000 ms, bubble 25.0%")
    assert lines[2] == f"wrote {png_path}"
    _assert_png(png_path)
