"""Host CPU per submitted task of the worker lanes, their wake-ups, and what they cost a Python loop.

    python -m benchmarks.calibration.lane_cost [--quick] [--json lane_cost.json]

Two cases, each queued in full before it starts (so lanes hold hundreds of pending tasks, as a
lowered 8-worker step does), each a chain per microbatch: upload -> compute -> download on
worker 0, whose download feeds worker 1's upload, and so on (transfers at mixed priorities):

- ``many_lanes``: the fake-stream backend, 8 workers x 3 lanes; each compute's device work
  takes ``--device-ms`` on its stream (a sleep on the executor: device time, GIL free), so the
  transfers behind it wait for issued-but-unfinished device work, the case where lanes used to
  look again every 0.5 ms;
- ``waiting_lanes``: the same with 16 microbatches of 20 ms computes: device-bound, the lanes
  mostly wait for device work, so what they take from the host while waiting shows;
- ``cpu_backend``: the CPU backend, 2 workers, no-op tasks: the bare bookkeeping per task.

Figures per case, each the best of ``--rounds``: ``cpu_us_per_task`` (process CPU seconds,
every thread, from the first submit to the last completion, per task: submits, lane looks,
completions, the executors), ``cpu_share`` (those CPU seconds per wall second: in
``waiting_lanes``, what lanes take while the devices work), ``wall_ms``; then, from ``WorkerPool.lane_counters()`` where the
pool has it: wake-ups (and per second), looks, tasks examined per look, and lane bookkeeping
µs per task. ``loop_slowdown``: a pure-Python counting loop's rate alone (just after, as long)
over its rate while the case runs beside it (the GIL the lanes take from the host thread that
launches kernels); on a machine loaded by other jobs it is noise-dominated, read ``cpu_share``.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import cli, markdown_table, write_json  # noqa: E402

from lightning_roundpipe.workers import TaskLabel, make_pool  # noqa: E402
import roundpipe_lab  # noqa: F401,E402  (registers the lab's fake_cuda backend, chosen by name below)


def _device_work(seconds: float):
    def run():
        time.sleep(seconds)  # on the fake stream's executor: device time, the GIL released
        return None
    return run


def submit_chains(pool, microbatches: int, device_s: float) -> list:
    """Queue every microbatch's chain across the workers; returns the last download of each."""
    compute_fn = _device_work(device_s) if device_s > 0 else (lambda: None)
    last = []
    for i in range(microbatches):
        prev = None
        for w in pool.workers:
            deps = [prev] if prev is not None else []
            up = w.submit("upload", lambda: None, deps, TaskLabel("act_in", "F0", i, w.index, "upload"), priority=i % 3)
            comp = w.submit("compute", compute_fn, [up], TaskLabel("forward", "F0", i, w.index, "compute"))
            prev = w.submit("download", lambda: None, [comp], TaskLabel("act_out", "F0", i, w.index, "download"),
                            priority=-(i % 2))
        last.append(prev)
    return last


class CountingLoop:
    """A host thread counting in pure Python: its rate shows how much GIL the lanes leave."""

    def __init__(self):
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lane-cost-loop", daemon=True)

    def _run(self):
        n = 0
        while not self._stop:
            n += 1
            if not n & 0x3FF:
                self.count = n
        self.count = n

    def __enter__(self):
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join(5)
        self.rate = self.count / (time.perf_counter() - self.t0)


def loop_rate_alone(seconds: float) -> float:
    with CountingLoop() as loop:
        time.sleep(seconds)
    return loop.rate


def run_case(backend: str, workers: int, microbatches: int, device_s: float, with_loop: bool) -> dict:
    pool = make_pool(backend, workers, timeout_s=120).start()
    try:
        time.sleep(0.05)  # lanes reach their idle wait
        counters = getattr(pool, "lane_counters", None)  # absent before the lanes were counted
        if counters is not None:
            pool.reset_lane_counters()
        loop = CountingLoop() if with_loop else None
        if loop is not None:
            loop.__enter__()
        c0, t0 = time.process_time(), time.perf_counter()
        outs = submit_chains(pool, microbatches, device_s)
        for o in outs:
            o.wait(120)
        pool.drain(120)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        if loop is not None:
            loop.__exit__()
        tasks = 3 * workers * microbatches
        row = {"tasks": tasks, "wall_ms": wall * 1e3, "cpu_us_per_task": cpu / tasks * 1e6, "cpu_share": cpu / wall}
        if loop is not None:
            row["loop_rate"] = loop.rate
        if counters is not None:
            c = counters()
            row.update(wakeups=c.wakeups, wakeups_per_s=c.wakeups / wall, looks=c.looks,
                       examined_per_look=c.tasks_examined / max(1, c.looks),
                       bookkeeping_us_per_task=c.bookkeeping_s / tasks * 1e6)
        return row
    finally:
        pool.shutdown()


CASES = {  # name -> (backend, workers, microbatches (None: --microbatches), compute device seconds (None: --device-ms))
    "many_lanes": ("fake_cuda", 8, None, None),
    "waiting_lanes": ("fake_cuda", 8, 16, 0.02),
    "cpu_backend": ("cpu", 2, None, 0.0),
}


def main(argv=None) -> int:
    p = cli(__doc__.splitlines()[0], quick="40 microbatches, 2 rounds (a few seconds)")
    p.add_argument("--microbatches", type=int, default=100, help="chains queued per case (default 100)")
    p.add_argument("--device-ms", type=float, default=2.0, help="device time of each compute in many_lanes (ms)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    microbatches, rounds = (40, 2) if args.quick else (args.microbatches, args.rounds)
    rows = []
    for name, (backend, workers, mb, device_s) in CASES.items():
        device_s = args.device_ms / 1e3 if device_s is None else device_s
        mb = microbatches if mb is None else mb
        best = min((run_case(backend, workers, mb, device_s, False) for _ in range(rounds)),
                   key=lambda r: r["cpu_us_per_task"])
        beside = run_case(backend, workers, mb, device_s, True)
        alone = loop_rate_alone(max(0.2, beside["wall_ms"] / 1e3))  # just after, as long: the same machine load
        rows.append({"case": name, "backend": backend, "workers": workers, "microbatches": mb,
                     "device_ms": device_s * 1e3, **best, "loop_slowdown": alone / max(beside["loop_rate"], 1e-9),
                     "wall_ms_beside_loop": beside["wall_ms"]})
    print(markdown_table(rows, [
        ("case", "case", "{}"), ("tasks", "tasks", "{}"), ("wall_ms", "wall ms", "{:.0f}"),
        ("cpu_us_per_task", "host CPU µs/task", "{:.0f}"), ("cpu_share", "CPU s/s", "{:.2f}"), ("wakeups", "wake-ups", "{}"),
        ("wakeups_per_s", "wake-ups/s", "{:.0f}"), ("looks", "looks", "{}"),
        ("examined_per_look", "examined/look", "{:.2f}"), ("bookkeeping_us_per_task", "bookkeeping µs/task", "{:.1f}"),
        ("loop_slowdown", "Python loop slowdown", "{:.2f}x"),
    ]))
    if args.json:
        write_json(args.json, {"rows": rows, "command": " ".join(["lane_cost"] + (argv or sys.argv[1:]))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
