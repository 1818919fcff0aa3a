"""The CUDA backend's protocol in CI, on fake streams: issue-time completions, device events,
``wait_event``, ``max_in_flight``, device timings; parity with the CPU backend, bit for bit,
under random delays in the streams (the race amplifier)."""

import threading
import time

import pytest
import torch
from torch import nn

from lightning_roundpipe import EngineOptions, PipelineEngine, Plan, simple_plan
from lightning_roundpipe.runtime import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.workers import make_pool

from _models import mlp


def engine_grads(backend, plan, microbatches, steps=2, **pool_kwargs):
    layers = mlp(depth=plan.num_layers, width=16, dropout=0.25, seed=3)
    pool = make_pool(backend, 2, **pool_kwargs)
    eng = PipelineEngine(layers, pool, plan, EngineOptions(microbatches=microbatches))
    g = torch.Generator().manual_seed(5)
    try:
        torch.manual_seed(11)
        for _ in range(steps):
            x = torch.randn(6, 16, generator=g, requires_grad=True)
            (eng(x) ** 2).mean().backward()
        return [p.grad.clone() for l in layers for p in l.parameters()] + [x.grad.clone()]
    finally:
        eng.close()


PLANS = [
    simple_plan(4, 2),
    Plan(6, [(0, 3), (3, 6)], [(0, 1), (1, 2), (2, 4), (4, 6)]),  # backward cut unlike forward
    Plan(5, [(0, 1), (1, 2), (2, 3), (3, 5)], [(0, 2), (2, 5)]),  # more stages than workers
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.to_text().replace(" ", ""))
def test_fake_streams_gradients_equal_cpu_backend_bit_for_bit(plan):
    ref = engine_grads("cpu", plan, 3)
    got = engine_grads("fake_cuda", plan, 3, stream_jitter_s=0.002, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_completion_is_set_at_issue_time_and_the_work_runs_on_the_stream():
    pool = make_pool("fake_cuda", 1).start()
    started = threading.Event()
    release = threading.Event()

    def work():
        started.set()
        release.wait(5)
        return 7

    try:
        w = pool.workers[0]
        from lightning_roundpipe.workers import TaskLabel

        c = w.submit("compute", work, [], TaskLabel("forward", "F0", 0, 0, "compute"))
        deadline = time.monotonic() + 2
        while not c.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert c.is_set() and not c.device_event.query()  # issued, not finished: as on CUDA
        assert started.wait(2)
        assert threading.current_thread().name != "roundpipe-stream-w0-compute"
        release.set()
        assert c.wait(2) == 7
        assert c.device_event.query()
    finally:
        pool.shutdown()


class Sleepy(nn.Linear):
    def forward(self, x):
        time.sleep(0.05)
        return super().forward(x)


def test_stream_backend_times_tasks_with_device_events_read_once_per_step():
    """Issue 11 item 7: the records of the stream backend come from events on the stream (the
    work's time, here 50 ms a layer), read once at the step's end, not from the lane's host time
    (an asynchronous issue that takes microseconds)."""
    layers = [Sleepy(8, 8) for _ in range(4)]
    pool = make_pool("fake_cuda", 2)
    pool.trace.enabled = True
    eng = PipelineEngine(layers, pool, simple_plan(4, 2), EngineOptions(microbatches=2))
    issue_times = []
    execute = pool.execute

    def timed_issue(lane, task):
        t0 = time.perf_counter()
        execute(lane, task)
        if lane.queue == "compute":
            issue_times.append(time.perf_counter() - t0)

    pool.execute = timed_issue
    try:
        out = eng(torch.randn(4, 8))
        assert pool.trace.records(eng.step_count) == []  # nothing read during the step
        out.sum().backward()
        records = pool.trace.records(eng.step_count)
    finally:
        eng.close()
    fwd = [r for r in records if r.kind == "forward"]
    bwd = [r for r in records if r.kind == "backward"]
    assert len(fwd) == 2 * 2 and len(bwd) == 4 * 2  # simple_plan(4, 2): 2 forward, 4 backward stages
    assert min(r.duration for r in fwd) >= 2 * 0.05 * 0.95  # two layers per forward stage
    assert min(r.duration for r in bwd) >= 0.05 * 0.95  # one layer, recomputed on the stream
    assert max(issue_times) < 0.05  # the lane only issued: host time would not see the work


def test_max_in_flight_bounds_copies_issued_ahead():
    pool = make_pool("fake_cuda", 1, max_in_flight=2).start()
    from lightning_roundpipe.workers import TaskLabel

    gate = threading.Event()
    try:
        w = pool.workers[0]
        blocker = w.submit("upload", lambda: gate.wait(5), [], TaskLabel("weights", "F0", -1, 0, "upload"))
        later = [w.submit("upload", lambda: None, [], TaskLabel("act_in", "F0", i, 0, "upload")) for i in range(3)]
        time.sleep(0.3)
        assert blocker.is_set() and later[0].is_set()  # two copies issued...
        assert not later[1].is_set() and not later[2].is_set()  # ...and no more while they run
        gate.set()
        for c in later:
            c.wait(2)
    finally:
        pool.shutdown()


def test_in_flight_copies_are_bounded_in_bytes_as_well_as_in_number():
    pool = make_pool("fake_cuda", 1, max_in_flight=8).start()
    pool.max_in_flight_bytes = 100
    from lightning_roundpipe.workers import TaskLabel

    gate = threading.Event()
    try:
        w = pool.workers[0]
        big = w.submit("download", lambda: gate.wait(5), [], TaskLabel("wgrad", "B0", 0, 0, "download"), nbytes=60)
        small = w.submit("download", lambda: None, [], TaskLabel("wgrad", "B0", 1, 0, "download"), nbytes=30)
        second = w.submit("download", lambda: None, [], TaskLabel("wgrad", "B0", 2, 0, "download"), nbytes=60)
        time.sleep(0.3)
        assert big.is_set() and small.is_set()  # 90 bytes issued: under the bound...
        assert not second.is_set()  # ...60 more would pass it: it waits for the first copy
        gate.set()
        second.wait(2)
        assert second.is_set()
        # A single copy larger than the bound still goes (alone).
        huge = w.submit("download", lambda: None, [], TaskLabel("wgrad", "B0", 3, 0, "download"), nbytes=1000)
        huge.wait(2)
        assert huge.is_set()
    finally:
        pool.shutdown()


class Many(nn.Module):
    """A layer of six small Linears: its weights go up in six chunks (one tensor per chunk here)."""

    def __init__(self, width):
        super().__init__()
        self.parts = nn.ModuleList(nn.Linear(width, width) for _ in range(6))

    def forward(self, x):
        time.sleep(0.05)
        for p in self.parts:
            x = p(x)
        return x


def _upload_order():
    """Forward, 2 workers, 4 stages: worker 1 runs F1 then F3, whose weights come in 12 chunks.
    Computes are slow (50 ms of stream work), so worker 1's inputs of F1 arrive one by one; the
    streams' random delays (3 ms on average) make each chunk's copy take a while."""
    torch.manual_seed(0)
    layers = [Sleepy(32, 32), Sleepy(32, 32), Sleepy(32, 32), Many(32)]
    pool = make_pool("fake_cuda", 2, stream_jitter_s=0.006, seed=2)
    pool.trace.enabled = True
    plan = Plan(4, [(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 2), (2, 4)])
    eng = PipelineEngine(layers, pool, plan, EngineOptions(microbatches=4, chunk_bytes=1))
    try:
        out = eng(torch.randn(8, 32))
        out.sum().backward()
        return pool.trace.records(eng.step_count)
    finally:
        eng.close()


def test_weight_prefetch_fills_the_gaps_between_activations():
    """Issue 15 item 4: the next stage's weights (F3 on worker 1) go up while F1 waits for its
    inputs, not behind the last of them: a transfer is issued once its input's device work is
    done, not once it is merely issued (the old rule, removed by issue 21, queued every act_in at
    the head of the FIFO stream, waiting for worker 0's computes, and the prefetch behind them)."""
    records = _upload_order()
    up = [r for r in records if r.worker == 1 and r.queue == "upload"]
    f3_chunks = [r for r in up if r.kind == "weights" and r.stage == "F3"]
    acts = sorted((r for r in up if r.kind == "act_in" and r.stage == "F1"), key=lambda r: r.microbatch)
    assert len(f3_chunks) == 12 and len(acts) == 4
    assert max(r.end for r in f3_chunks) <= acts[-1].start
    # and an activation never waits behind the prefetch for more than two chunks (max_in_flight)


def _train(backend, staleness, pinned, compute_dtype, opt_name, steps=4, jitter=0.0):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.1)) for _ in range(5)],
                        nn.Linear(16, 4))
    # The runtime pins what the uploads read (shadows or masters) per ``pinned`` on stream backends.
    options = RuntimeOptions(microbatches=3, compute_dtype=compute_dtype, testing={"jitter_s": jitter}, seed=7,
                             staleness=staleness, pinned=pinned)
    runtime = RoundPipeRuntime.attach(net, backend, 2, options)
    if opt_name == "adamw":
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
    ov = runtime.overlap_optimizer(opt)
    if backend == "fake_cuda" and pinned != "off":
        shadows = runtime.engine.shadows
        uploaded = shadows.buffers() if shadows is not None else runtime.engine.master_parameters()
        assert runtime.pool.pinned_bytes == sum(t.numel() * t.element_size() for t in uploaded)
    g = torch.Generator().manual_seed(1)
    try:
        torch.manual_seed(3)
        for _ in range(steps):
            x, y = torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)

            def closure():
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype is not None):
                    out = net(x)
                loss = nn.functional.mse_loss(out.float(), y)
                loss.backward()
                return loss

            opt.step(closure)  # inside step(closure): layers step early, during backward
        runtime.join()
        assert ov.early_steps
        if backend == "fake_cuda":  # downloads landed in reused host buffers (issue 15 item 5)
            assert runtime.pool.host_buffers.reuses > 0
        return [p.detach().clone() for p in net.parameters()]
    finally:
        runtime.detach()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pinned", ["alloc", "register", "off"])
def test_race_amplifier_bit_identical_to_cpu_backend(pinned):
    """Random delays in the fake streams (not the host threads), early optimizer steps, exact and
    ``staleness=1``, fp32 and bf16 shadows, SGD and AdamW: the CPU backend's weights, bit for bit."""
    for staleness, dtype, opt_name in [(0, None, "adamw"), (1, None, "sgd"), (0, torch.bfloat16, "sgd"),
                                       (1, torch.bfloat16, "adamw")]:
        ref = _train("cpu", staleness, pinned, dtype, opt_name)
        got = _train("fake_cuda", staleness, pinned, dtype, opt_name, jitter=0.003)
        diff = [(a - b).abs().max().item() for a, b in zip(ref, got)]
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), (staleness, dtype, opt_name, diff)


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["32-true", "bf16"])
@pytest.mark.parametrize("pinned", ["alloc", "register", "off"])
def test_pinned_policies_pin_exactly_what_is_uploaded(pinned, compute_dtype):
    """Issue 15 item 5: the uploads read the shadows where they exist, else the masters; the
    policy pins exactly those, once, and no upload then reads pageable memory (before: "register"
    pinned the masters while uploads read unpinned shadows, and with "alloc" and no shadows every
    upload made a pinned staging copy)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    runtime = RoundPipeRuntime.attach(net, "fake_cuda", 2, RuntimeOptions(microbatches=2, compute_dtype=compute_dtype,
                                                                          pinned=pinned))
    try:
        masters = runtime.engine.master_parameters()
        n_params = sum(p.numel() for p in masters)
        shadows = runtime.shadows  # made by the runtime exactly when a compute dtype is set
        assert (shadows is not None) == (compute_dtype is not None)
        assert runtime.engine.shadows is shadows
        pinned_bytes = runtime.pool.pinned_bytes
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype is not None):
            out = net(torch.randn(4, 16))
        out.float().sum().backward()
        per_param = 2 if compute_dtype is not None else 4
        if pinned == "off":
            assert pinned_bytes == 0 and runtime.pool.pageable_upload_bytes > 0
        else:
            assert pinned_bytes == n_params * per_param  # exactly the uploaded bytes: no rounding
            assert runtime.pool.pageable_upload_bytes == 0
        if shadows is not None:
            assert shadows.nbytes() == n_params * 2
    finally:
        runtime.detach()


@pytest.mark.parametrize("padded", [False, True])
def test_hf_fused_last_stage_on_fake_streams_matches_unpipelined(padded):
    """A tiny Llama through the fused last stage (forward, loss and backward at once, eager
    backward stages) on jittered fake streams: the unpipelined model's loss and gradients."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         attn_implementation="sdpa"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (5, 12), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    g_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    rt = RoundPipeRuntime.attach(model, "fake_cuda", 2, RuntimeOptions(microbatches=3, testing={"jitter_s": 0.002}))
    try:
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(out.loss.item() / ref.loss.item() - 1) <= 1e-6
        out.loss.backward()
        got = {n: p.grad for n, p in model.named_parameters()}
    finally:
        rt.detach()
    assert got.keys() == g_ref.keys()
    assert max(((got[k] - g_ref[k]).norm() / g_ref[k].norm()).item() for k in g_ref) <= 1e-5
