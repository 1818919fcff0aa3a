"""The host thread's intra-op count and the CPU backend's reuse of freed host memory.

The caller's thread runs the loss and the whole-step optimizer while every worker waits: it
must keep its own torch thread count when the lanes start and set theirs, and the large tensors
a step allocates afresh must come from freed memory, not from new pages that fault.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.engine import microbatch
from lightning_roundpipe.options import OptionError
from lightning_roundpipe.workers import TaskLabel, backend_class, make_pool
from lightning_roundpipe.host.host_allocator import keep_freed_memory
from lightning_roundpipe.engine.engine import intra_op_threads


def _in_fresh_thread(fn):
    """Run ``fn`` on a new thread (its torch thread count not initialised yet); its result."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised on the test's thread
            out["error"] = exc

    t = threading.Thread(target=body)
    t.start()
    t.join(60)
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.timeout(60)
def test_the_callers_thread_keeps_its_intra_op_count_when_the_lanes_start():
    before = torch.get_num_threads()

    def caller():
        torch.set_num_threads(2)  # set, not yet initialised: the first parallel call would read the last count set
        pool = make_pool("cpu", 2, timeout_s=10).start()
        try:
            lanes = [w.submit("compute", torch.get_num_threads, [], TaskLabel("forward", "F0", 0, w.index, "compute")).wait(10)
                     for w in pool.workers]
        finally:
            pool.shutdown()
        return torch.get_num_threads(), lanes, pool.caller_threads

    try:
        assert _in_fresh_thread(caller) == (2, [1, 1], 2)  # was (1, [1, 1]): the lanes' count leaked to the caller
    finally:
        torch.set_num_threads(before)


@pytest.mark.timeout(60)
def test_a_calls_host_phases_run_on_one_thread_and_the_callers_loss_on_its_own(monkeypatch):
    seen = []
    add = microbatch.OutputAssembly.add
    monkeypatch.setattr(microbatch.OutputAssembly, "add",
                        lambda self, m, carry: (seen.append(torch.get_num_threads()), add(self, m, carry))[1])
    before = torch.get_num_threads()

    def caller():
        torch.set_num_threads(2)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
        reference = [p.detach().clone() for p in net.parameters()]
        runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=4, step_metrics=False))
        try:
            x = torch.randn(8, 8)
            out = net(x)
            at_loss = torch.get_num_threads()
            out.square().sum().backward()
            grads = [p.grad.clone() for p in net.parameters()]
        finally:
            runtime.detach()
        ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
        with torch.no_grad():
            for p, r in zip(ref.parameters(), reference):
                p.copy_(r)
        ref(x).square().sum().backward()
        return at_loss, torch.get_num_threads(), grads, [p.grad for p in ref.parameters()]

    try:
        at_loss, after, grads, ref_grads = _in_fresh_thread(caller)
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1, 1, 1]  # every microbatch output merged on one thread, while the workers compute
    assert (at_loss, after) == (2, 2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


def test_intra_op_threads_gives_the_count_back_also_when_the_block_raises():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with pytest.raises(RuntimeError, match="inside"):
        with intra_op_threads(target):
            assert torch.get_num_threads() == target
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before


def _printed_by(script: str, mode: str) -> list[str]:
    """What ``script`` prints, run with ``mode`` in a fresh process (glibc's settings are per process)."""
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


_FAULTS = """
import resource, sys, torch
from lightning_roundpipe.host.host_allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def touch():
    t = torch.empty(12 * 2**20)  # 48 MiB: above glibc's largest default mmap threshold (32 MiB)
    t.fill_(1.0)
    return t
for _ in range(3):  # the first ones are new memory either way (a second region once small blocks split the first)
    del_me = touch(); del del_me
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # a step's tensors, allocated afresh step after step
    again = touch(); del again
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_large_blocks_are_reused_instead_of_faulting_in_new_pages():
    kept, reused = _printed_by(_FAULTS, "keep")
    _, fresh = _printed_by(_FAULTS, "glibc")
    reused, fresh = int(reused), int(fresh)
    assert kept == "True"
    assert fresh > 3 * 12_000  # 3 x 48 MiB of new 4 KiB pages (12,288 each), each faulting on first touch
    assert reused < 1_000


_THREAD_HEAPS = """
import ctypes, resource, sys, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[1] == "keep":
    from lightning_roundpipe.host.host_allocator import keep_freed_memory
    assert keep_freed_memory()
else:  # the thresholds alone, as keep_freed_memory set them before the top pad
    from lightning_roundpipe.host.host_allocator import KEEP_BYTES, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
N = 40 << 20  # two of these do not fit one 64 MiB heap of a thread's arena
faults = []
def lane():  # a thread other than the main one: its own arena
    held = libc.malloc(N); libc.memset(held, 1, N)
    for _ in range(4):  # a step's tensor, allocated and freed again step after step
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        p = libc.malloc(N); libc.memset(p, 1, N); libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
    libc.free(held)
t = threading.Thread(target=lane); t.start(); t.join()
print(*faults)
"""


@pytest.mark.slow  # about 13 s of allocation; its sibling test of freed blocks runs by default
@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_threads_emptied_heap_is_kept_instead_of_faulting_in_new_pages_every_step():
    kept = [int(v) for v in _printed_by(_THREAD_HEAPS, "keep")]
    thresholds_only = [int(v) for v in _printed_by(_THREAD_HEAPS, "thresholds")]
    assert thresholds_only[0] > 10_000 and kept[0] > 10_000  # the first block is new memory either way
    assert all(f > 10_000 for f in thresholds_only[1:])  # 40 MiB of new 4 KiB pages every time: the heap was unmapped
    assert all(f < 100 for f in kept[1:])  # the emptied heap stays: its pages are reused


def test_the_cpu_backend_keeps_freed_memory_by_default_and_the_option_turns_it_off():
    assert keep_freed_memory() is True  # glibc on this platform; stays set for the process
    pool_options = backend_class("cpu").options_from
    assert make_pool("cpu", 1, **pool_options(RuntimeOptions())).reuses_freed_memory is True
    assert make_pool("cpu", 1, **pool_options(RuntimeOptions(cpu_reuse_freed_memory=False))).reuses_freed_memory is False
    assert make_pool("cpu", 1).reuses_freed_memory is False  # a pool built by hand: glibc's own thresholds
    with pytest.raises(OptionError, match="cpu_reuse_freed_memory"):
        RuntimeOptions(cpu_reuse_freed_memory="yes").validate()
