"""One "node" of the two-process tests: run by tests/distributed/test_multinode.py as a subprocess.

Usage: python multinode_worker.py MODE OUT_DIR   (rank and port come from NODE_RANK / MASTER_PORT)
MODE: "seq" (the MLP of _models), "accum", "big", "lora" (the tiny peft model of adapters/test_hf_pipeline),
or "die" (rank 1 exits abruptly after the forward of its third step, before its backward).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.adapters

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from _models import SeqModule, make_data  # noqa: E402
from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.tracing.timeline import hidden_share  # noqa: E402


class Conveniences(SeqModule):
    """Uses Lightning's distributed conveniences from the training step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("synced_loss", loss, sync_dist=True)
        if batch_idx == 0:
            s = self.trainer.strategy
            s.barrier()
            gathered = self.all_gather(torch.tensor([float(self.global_rank)]))
            self.seen = {
                "broadcast": s.broadcast(f"from rank {self.global_rank}"),
                "all_gather": gathered.flatten().tolist(),
                "reduce_sum": float(s.reduce(torch.tensor(float(self.global_rank + 1)), reduce_op="sum")),
                "sampler": type(self.trainer.train_dataloader.sampler).__name__,
            }
        return loss


class DieMidStep(L.Callback):
    """Rank 1 vanishes in the middle of step 3: its peer is already in backward, all-reducing."""

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_rank == 1 and trainer.global_step == 2:
            os._exit(17)


class Grab(L.Callback):
    def __init__(self):
        self.bytes, self.records = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.bytes.append(trainer.strategy.last_bytes_reduced)
        if os.environ.get("RP_DEBUG"):
            print("DEBUG", trainer.global_rank, batch_idx, batch[0][:, 0].tolist() if isinstance(batch, (list, tuple)) else "", flush=True)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if os.environ.get("RP_DEBUG"):
            print("GRAD", trainer.global_rank, next(pl_module.parameters()).grad.flatten()[:3].tolist(), flush=True)

    def on_train_end(self, trainer, pl_module):
        self.records = trainer.strategy.runtime.trace.records()


def main():
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["NODE_RANK"])
    torch.manual_seed(0)
    accumulate = 1
    if mode == "seq":
        module = Conveniences(opt="adamw")
        data = DataLoader(make_data(n=40), batch_size=4)
        max_steps = 5
    elif mode == "accum":
        module = SeqModule(opt="adamw")
        data = DataLoader(make_data(n=32), batch_size=4)
        max_steps, accumulate = 2, 2
    elif mode == "die":
        module = SeqModule(opt="adamw")
        data = DataLoader(make_data(n=40), batch_size=4)
        max_steps = 5
    elif mode == "big":  # for the overlap figure: enough compute that communication can hide
        module = SeqModule(opt="adamw", width=512, depth=8)
        data = DataLoader(make_data(n=64, width=512), batch_size=16)
        max_steps = 4
    else:
        from tests.adapters.test_hf_pipeline import LoraFineTune, batch

        module = LoraFineTune()
        ids, mask, labels = batch(padded=True, seed=3)
        items = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(4)] * 2
        data = DataLoader(items, batch_size=2)
        max_steps = 2
    grab = Grab()
    callbacks = [grab] + ([DieMidStep()] if mode == "die" else [])
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(microbatches=2, timeout=float(os.environ.get("RP_TIMEOUT", 60)), trace_steps=max_steps,
                                   testing={"compute_delay_s": 0.002}, overlap_optimizer=os.environ.get("RP_OVERLAP", "1") == "1"),
        accelerator="cpu", devices=2, num_nodes=2, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, gradient_clip_val=0.05,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(module, data)
    trainer.save_checkpoint(out / "two_node.ckpt")
    torch.save({n: p.detach().clone() for n, p in module.named_parameters()}, out / f"rank{rank}.pt")
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    records = grab.records
    comm = [r for r in records if r.kind == "allreduce"]
    (out / f"rank{rank}.json").write_text(json.dumps({
        "bytes_reduced": grab.bytes, "trainable_bytes": trainable, "total_bytes": total,
        "allreduce_hidden_share": hidden_share(records, kind="allreduce") if comm else None,
        "allreduce_count": len(comm), "world_size": trainer.world_size, "global_rank": trainer.global_rank,
        "conveniences": getattr(module, "seen", None),
        "logged_loss": float(trainer.callback_metrics["synced_loss"]) if "synced_loss" in trainer.callback_metrics else None,
    }))


if __name__ == "__main__":
    main()
