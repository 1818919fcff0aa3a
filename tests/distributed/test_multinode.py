"""Two "nodes" (two processes, 2 CPU workers each) over gloo on localhost."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from tests._models import SeqModule, fit, make_data, weight_error, weights  # also imported by benchmarks/

pytestmark = pytest.mark.slow  # two processes per test: 20-60 s each on 2 cores

HERE = Path(__file__).resolve().parents[1]  # tests/: multinode_worker.py, _models


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_nodes(mode: str, out: Path, timeout=150, **extra_env):
    """Both processes' (return code, output), in rank order."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK="0", PYTHONUNBUFFERED="1", **extra_env)
        procs.append(subprocess.Popen([sys.executable, str(HERE / "multinode_worker.py"), mode, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return [(p.returncode, text) for p, text in zip(procs, outputs)]


def run_two_nodes(mode: str, out: Path, timeout=150):
    for code, text in start_two_nodes(mode, out, timeout):
        assert code == 0, text[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_two_nodes_train_identically_and_match_one_process(tmp_path):
    info = run_two_nodes("seq", tmp_path)
    w0, w1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # bit-identical on both ranks
    assert [i["world_size"] for i in info] == [2, 2] and [i["global_rank"] for i in info] == [0, 1]
    # single process on the same global batch: Lightning injected a DistributedSampler (shuffled,
    # seed 0) and each node took 4 samples per step; one process takes both nodes' 8.
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    order = [i for k in range(5) for rank in (0, 1) for i in perm[rank::2][4 * k: 4 * k + 4]]
    ref = SeqModule(opt="adamw")
    init = weights(ref)
    fit(ref, "auto", max_steps=5, batch_size=8, data=torch.utils.data.Subset(make_data(n=40), order),
        gradient_clip_val=0.05)
    assert weight_error(w0, weights(ref), init) <= 1e-4
    # Lightning's distributed conveniences
    for r, i in enumerate(info):
        seen = i["conveniences"]
        assert seen["broadcast"] == "from rank 0" and seen["all_gather"] == [0.0, 1.0] and seen["reduce_sum"] == 3.0
        assert seen["sampler"] == "DistributedSampler"
    assert info[0]["logged_loss"] == info[1]["logged_loss"]  # sync_dist=True: the mean over nodes
    # one all-reduce per step of exactly the trainable bytes, overlapped with backward
    assert info[0]["bytes_reduced"] == [info[0]["trainable_bytes"]] * 5
    assert info[0]["allreduce_count"] >= 5
    # the two-node checkpoint resumes in a single-node run
    more = SeqModule(opt="adamw", seed=9)
    t = L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, max_steps=7, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    t.fit(more, DataLoader(make_data(n=40), batch_size=8), ckpt_path=str(tmp_path / "two_node.ckpt"))
    assert t.global_step == 7


def test_accumulation_steps_communicate_nothing(tmp_path):
    info = run_two_nodes("accum", tmp_path)
    trainable = info[0]["trainable_bytes"]
    assert info[0]["bytes_reduced"] == [0, trainable, 0, trainable]  # per batch: accumulate, then sync
    w0, w1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_lora_communicates_only_adapter_gradients(tmp_path):
    info = run_two_nodes("lora", tmp_path)
    for i in info:
        assert i["trainable_bytes"] < i["total_bytes"] / 10
        assert i["bytes_reduced"] == [i["trainable_bytes"]] * 2
    w0, w1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_a_node_dying_mid_step_fails_its_peer_within_the_timeout(tmp_path):
    """Rank 1 exits between its forward and backward of step 3; rank 0, already all-reducing its
    layers' gradients, fails with NodeSyncError naming its rank and the layer, well within the
    10 s timeout (gloo reports the reset connection), instead of hanging."""
    t0 = time.monotonic()
    (code0, text0), (code1, _) = start_two_nodes("die", tmp_path, timeout=120, RP_TIMEOUT="10")
    assert code1 == 17
    assert code0 != 0
    assert "NodeSyncError: rank 0: the gradient all-reduce of layer" in text0
    assert "a peer node of the 2 died or cannot be reached (timeout 10s)" in text0
    assert time.monotonic() - t0 < 90


def test_unreachable_node_gives_a_clear_error(tmp_path):
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="1", WORLD_SIZE="2", LOCAL_RANK="0")
    code = (
        "import lightning as L, torch\n"
        "from _models import SeqModule, make_data\n"
        "from torch.utils.data import DataLoader\n"
        "from lightning_roundpipe import RoundPipeStrategy\n"
        "t = L.Trainer(strategy=RoundPipeStrategy(timeout=3), accelerator='cpu', devices=2, num_nodes=2, max_steps=1,"
        " logger=False, enable_checkpointing=False, enable_progress_bar=False)\n"
        "t.fit(SeqModule(), DataLoader(make_data(), batch_size=4))\n"
    )
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])  # for _models
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90)
    assert p.returncode != 0
    assert "rank 1 of 2 could not join the other nodes" in p.stderr and "within 3s" in p.stderr
