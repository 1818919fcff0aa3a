"""Issue 20 item 14: two processes saving into one folder at the same time both keep their
checkpoints: a save's clean-up of interrupted saves leaves another writer's temporary file alone."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lightning_roundpipe.lightning.checkpoint_io import AtomicCheckpointIO, remove_interrupted_saves

WRITER = textwrap.dedent("""
    import os, sys, time
    import torch
    from lightning_roundpipe.lightning.checkpoint_io import AtomicCheckpointIO
    root, name, trials, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    io = AtomicCheckpointIO()
    for trial in range(trials):
        folder = os.path.join(root, f"trial{trial}")
        while not os.path.exists(os.path.join(folder, "go")):  # both writers start each trial together
            time.sleep(0.001)
        for i in range(rounds):
            io.save_checkpoint({"writer": name, "round": i, "blob": torch.full((2_000_000,), float(i))},
                               os.path.join(folder, name + ".ckpt"))
            saved = torch.load(os.path.join(folder, name + ".ckpt"), weights_only=True)
            assert saved["writer"] == name and saved["round"] == i, saved
        open(os.path.join(folder, name + ".done"), "w").close()
""")


@pytest.mark.timeout(240)  # two interpreters importing Lightning: slow on a loaded machine
def test_two_processes_saving_into_one_folder_keep_both_checkpoints(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    trials, rounds = 3, 6  # before the fix the first checkpoint was lost in 3 of 3 trials
    for trial in range(trials):
        (tmp_path / f"trial{trial}").mkdir()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name, str(trials), str(rounds)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name in ("first", "second")]
    deadline = time.monotonic() + 200
    try:
        for trial in range(trials):
            folder = tmp_path / f"trial{trial}"
            (folder / "go").touch()
            while not all((folder / f"{n}.done").exists() for n in ("first", "second")):
                assert all(w.poll() is None for w in writers), [w.communicate()[1][-2000:] for w in writers]
                assert time.monotonic() < deadline, "the writers did not finish"
                time.sleep(0.01)
            for name in ("first", "second"):
                saved = torch.load(folder / f"{name}.ckpt", weights_only=True)
                assert saved["writer"] == name and saved["round"] == rounds - 1
                assert torch.equal(saved["blob"], torch.full((2_000_000,), float(rounds - 1)))
            assert sorted(os.listdir(folder)) == ["first.ckpt", "first.done", "go", "second.ckpt", "second.done"]
        for w in writers:
            assert w.wait(timeout=30) == 0, w.communicate()[1][-2000:]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
                w.wait(timeout=30)


def test_a_temporary_file_a_live_writer_holds_is_not_removed(tmp_path):
    import fcntl

    owned = tmp_path / ".tmp-a.ckpt-live"
    with open(owned, "wb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a save in progress holds
        stale = tmp_path / ".tmp-b.ckpt-dead"
        stale.write_bytes(b"left by a killed save")
        assert remove_interrupted_saves(str(tmp_path)) == [str(stale)]
        assert owned.exists()
    AtomicCheckpointIO().save_checkpoint({"v": 1}, tmp_path / "c.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["c.ckpt"]  # released: an interrupted save's leftover now
