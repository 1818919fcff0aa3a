"""Every blocking wait in the package has a timeout, or a written reason why it needs none.

A static check over ``src/lightning_roundpipe`` and the lab's ``src/roundpipe_lab`` (its paths below start
with ``roundpipe_lab/``): every call of a blocking primitive (``.wait``,
``.wait_for``, ``.join``, ``.acquire``, ``.result``, a queue's ``.get``, ``synchronize``,
``barrier``, ``.recv``, ``.communicate``) must pass a timeout, or be listed in ``ALLOWED`` with
the reason it is bounded anyway (a wrapper of ours that waits with its own timeout, a collective
bounded by its process group's timeout, an idle worker loop woken by its own stop). A listed
call that no longer exists fails the test too, so the list stays true.

What counts as passing a timeout: a ``timeout``/``timeout_s`` keyword; for ``wait``, ``join``,
``result``, ``recv`` and ``communicate`` any positional argument (their only one is the
timeout); for ``acquire`` a second positional argument or ``blocking=False``; for ``synchronize`` and ``barrier`` an
argument whose text names a timeout or deadline. ``str.join``/``os.path.join`` and ``dict.get``
(which takes a key) are not waits.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "lightning_roundpipe"
LAB = SRC.parent / "roundpipe_lab"
BLOCKING = {"wait", "wait_for", "join", "acquire", "result", "get", "synchronize", "barrier", "recv", "communicate"}
ONE_ARGUMENT_IS_THE_TIMEOUT = {"wait", "join", "result", "recv", "communicate"}

OURS_BOUNDED = "a method of ours whose own waits are bounded by the timeout option (checked by this test in its body)"
ALLOWED = {
    ("adapters/hf_runtime.py", "self.runtime.join()"): f"RoundPipeRuntime.join: {OURS_BOUNDED}",
    ("lightning/strategy.py", "self.join()"): f"RoundPipeStrategy.join -> RoundPipeRuntime.join: {OURS_BOUNDED}",
    ("lightning/strategy.py", "self.runtime.join()"): f"RoundPipeRuntime.join: {OURS_BOUNDED}",
    ("optim/overlap.py", "self.join()"): f"OverlappedOptimizer.join (one deadline for all versions): {OURS_BOUNDED}",
    ("runtime.py", "ov.join()"): f"OverlappedOptimizer.join: {OURS_BOUNDED}",
    ("runtime.py", "self.join()"): f"RoundPipeRuntime.join -> OverlappedOptimizer.join: {OURS_BOUNDED}",
    ("workers/completions.py", "v.result()"): "Deferred.result waits with the timeout_s it was made with",
    ("lightning/weight_reads.py", "self.join()"):
        f"JoinedRead.join is the runtime's join that join_before_reads was given (RoundPipeRuntime.join): {OURS_BOUNDED}",
    ("lightning/checkpoint_integrity.py", "done.result()"):
        "a CRC-32 check of one checkpoint entry on a thread of a local pool: CPU work over a memory-mapped file "
        "of known size, no wait on another party; an error in it is re-raised here",
    ("lightning/node_collectives.py", "torch.distributed.barrier()"):
        "bounded by the process group's timeout: the strategy creates the gloo group with timeout=options.timeout",
    ("finetune/config.py", "HydraConfig.get()"): "not a wait: returns Hydra's current config",
    ("optim/host_lane.py", "self._ready.wait()"):
        "the optimizer lane's idle wait for its next job; close() puts None to end it, and callers wait on each "
        "job's Completion with a timeout",
    ("distributed/gradient_sync.py", "self._watch.get()"):
        "the all-reduce watcher's idle wait for its next reduction; close() puts None to end it, and the host waits "
        "on each reduction with timeout_s",
    ("roundpipe_lab/fake_cuda/emulated.py", "cond.wait()"):
        "the emulated streams' clock thread's idle wait for its next event to complete; complete_at() and close() "
        "wake it, and callers wait on the events with timeouts",
    ("roundpipe_lab/fake_cuda/streams.py", "self._cond.wait()"):
        "a fake stream executor's idle wait for its next item; stop() wakes it, and callers wait on the items' "
        "events with timeouts",
    ("workers/cuda_streams.py", "self.raw.synchronize()"):
        "CudaEvent.block: a CUDA stream's event waiter blocks on its oldest awaited event (CUDA events take no "
        "timeout); the lane task waiting for that event keeps the pool's timeout and names it, and the waiter is "
        "a daemon thread",
    ("finetune/throughput.py", "torch.cuda.synchronize(index)"):
        "torch.cuda.synchronize takes no timeout; the throughput callback calls it after a training batch whose "
        "device work the pipeline already waited for with bounded waits, so only work issued outside it can remain",
}


def _passes_a_timeout(call: ast.Call) -> bool:
    name = call.func.attr
    if {k.arg for k in call.keywords} & {"timeout", "timeout_s"}:
        return True
    if name in ONE_ARGUMENT_IS_THE_TIMEOUT:
        return bool(call.args)
    if name == "acquire":
        blocking = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "blocking"), None)
        return len(call.args) >= 2 or (isinstance(blocking, ast.Constant) and blocking.value is False)
    return any(word in ast.unparse(arg).lower() for arg in call.args for word in ("timeout", "deadline"))


def _not_a_wait(call: ast.Call) -> bool:
    name, receiver = call.func.attr, call.func.value
    if name == "join":
        return isinstance(receiver, (ast.Constant, ast.JoinedStr)) or ast.unparse(receiver) in ("os.path", "posixpath")
    if name == "get":
        return bool(call.args)  # dict.get(key[, default]); a blocking queue get takes no key
    return False


def blocking_calls_without_timeout() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(SRC.rglob("*.py")) + sorted(LAB.rglob("*.py")):
        name = path.relative_to(SRC).as_posix() if path.is_relative_to(SRC) else path.relative_to(SRC.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in BLOCKING
                    and not _not_a_wait(node) and not _passes_a_timeout(node)):
                found.append((name, node.lineno, ast.unparse(node)))
    return found


def test_every_blocking_wait_has_a_timeout_or_a_reason():
    found = blocking_calls_without_timeout()
    unjustified = [f"{path}:{line}: {text}" for path, line, text in found if (path, text) not in ALLOWED]
    assert not unjustified, "blocking waits without a timeout (pass one, or add a reason to ALLOWED):\n" + "\n".join(
        unjustified)
    stale = sorted(set(ALLOWED) - {(path, text) for path, _, text in found})
    assert not stale, f"ALLOWED lists calls that no longer exist: {stale}"
    assert all(len(reason) >= 30 for reason in ALLOWED.values())


@pytest.mark.parametrize("source,flagged", [
    ("event.wait()", True), ("event.wait(5)", False), ("cond.wait(timeout=t)", False),
    ("thread.join()", True), ("thread.join(1.0)", False), ("', '.join(parts)", False), ("os.path.join(a, b)", False),
    ("q.get()", True), ("q.get(timeout=1)", False), ("d.get(key)", False),
    ("lock.acquire()", True), ("lock.acquire(True, 2)", False), ("lock.acquire(timeout=2)", False),
    ("lock.acquire(blocking=False)", False), ("lock.acquire(blocking=True)", True), ("lock.acquire(False)", False),
    ("future.result()", True), ("future.result(3)", False),
    ("torch.cuda.synchronize()", True), ("event.synchronize()", True), ("pool.synchronize(deadline - now)", False),
    ("cond.wait_for(pred)", True), ("cond.wait_for(pred, timeout=2)", False), ("dist.barrier()", True),
])
def test_the_check_tells_waits_with_and_without_a_timeout(source, flagged):
    call = ast.parse(source, mode="eval").body
    assert (not _not_a_wait(call) and not _passes_a_timeout(call)) is flagged
