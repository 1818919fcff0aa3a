"""A trace directory that becomes unwritable during fit: the finished fit stays finished, with a
warning that names ``trace_dir`` (issue 43, item 11). Tests run as root, which ignores permission
bits, so the failure is made real by turning the folder into a regular file, or injected as the
``PermissionError`` a read-only folder gives."""

import shutil

import lightning as L
import pytest
import torch

from _models import SeqModule, fit, weights
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.tracing import chrome


class ReplaceFolderByFile(L.Callback):
    """At the last step, the trace folder (checked writable at set-up) becomes a regular file."""

    def __init__(self, folder, last_step):
        self.folder, self.last_step = folder, last_step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.last_step:
            shutil.rmtree(self.folder)
            self.folder.write_text("not a folder any more")


def _plain_run():
    module = SeqModule(opt="adamw")
    fit(module, RoundPipeStrategy(microbatches=2), devices=2, max_steps=3, record_grads=False)
    return weights(module)


@pytest.mark.timeout(90)
def test_trace_folder_replaced_by_a_file_warns_and_the_fit_finishes(tmp_path):
    folder = tmp_path / "trace"
    folder.mkdir()
    module = SeqModule(opt="adamw")
    strategy = RoundPipeStrategy(microbatches=2, trace_steps=2, trace_dir=str(folder))
    with pytest.warns(UserWarning, match=r"could not write its timeline to RoundPipeStrategy\(trace_dir='.*trace'\)"):
        trainer, _ = fit(module, strategy, devices=2, max_steps=3, record_grads=False,
                         callbacks=[ReplaceFolderByFile(folder, 3)])
    assert trainer.state.status == "finished" and trainer.global_step == 3
    plain = _plain_run()
    assert all(torch.equal(w, plain[k]) for k, w in weights(module).items())  # the steps trained as without a trace


@pytest.mark.timeout(90)
def test_permission_error_while_writing_the_trace_warns_and_the_fit_finishes(tmp_path, monkeypatch):
    def read_only(records, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(chrome, "to_chrome_trace", read_only)
    import lightning_roundpipe.tracing.timeline as timeline
    monkeypatch.setattr(timeline, "to_chrome_trace", read_only)
    module = SeqModule(opt="adamw")
    strategy = RoundPipeStrategy(microbatches=2, trace_steps=1, trace_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=r"trace_dir=.*Permission denied"):
        trainer, _ = fit(module, strategy, devices=2, max_steps=2, record_grads=False)
    assert trainer.state.status == "finished" and trainer.global_step == 2
    assert not list(tmp_path.glob("roundpipe_*"))
