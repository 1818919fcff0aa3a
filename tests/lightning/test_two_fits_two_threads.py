"""Two fits in one process, on two threads, each with its own Trainer and module (issue 43, item 9):
both run, and each gives the weights the default strategy gives that fit alone. Before, one of
them failed with ``UnseededDraw``: the other fit's DataLoader drew its base seed from torch's CPU
generator while this fit's layers ran."""

import threading

import pytest
import torch

from _models import SeqModule, fit, make_data, weights
from lightning_roundpipe import RoundPipeStrategy


def _reference(opt, seed):
    module = SeqModule(opt=opt, seed=seed)
    fit(module, "auto", devices=1, max_steps=12, batch_size=4, record_grads=False, data=make_data(n=8))
    return weights(module)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_two_fits_on_two_threads_both_run_and_each_matches_the_default_strategy(opt):
    references = {seed: _reference(opt, seed) for seed in (0, 1)}
    modules = {seed: SeqModule(opt=opt, seed=seed) for seed in (0, 1)}
    errors, start = {}, threading.Barrier(2)

    def one_fit(seed):
        try:
            start.wait()
            fit(modules[seed], RoundPipeStrategy(microbatches=2, overlap_optimizer=True), devices=2, max_steps=12,
                batch_size=4, record_grads=False, data=make_data(n=8))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors[seed] = err

    threads = [threading.Thread(target=one_fit, args=(seed,), name=f"fit-{seed}") for seed in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not any(t.is_alive() for t in threads)
    assert errors == {}
    for seed, module in modules.items():
        for name, w in weights(module).items():
            ref, init = references[seed][name], weights(SeqModule(opt=opt, seed=seed))[name]
            assert (w - ref).norm() <= 1e-4 * max((ref - init).norm(), 1e-12), (seed, name)


def test_a_served_dataloader_keeps_its_class_and_batches_and_waits_only_beside_another_fit():
    from torch.utils.data import DataLoader

    from lightning_roundpipe.lightning.concurrent_fits import LiveFit, gate_data_draws, live_fits

    class MyLoader(DataLoader):
        pass

    loader = gate_data_draws(MyLoader(make_data(n=8), batch_size=4, shuffle=True,
                                      generator=torch.Generator().manual_seed(3)))
    assert isinstance(loader, MyLoader) and type(loader).__name__ == "MyLoader"
    assert gate_data_draws(loader) is loader and type(gate_data_draws(loader)).__mro__[1] is MyLoader
    plain = [b[0] for b in MyLoader(make_data(n=8), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))]
    before = live_fits()
    fits = [LiveFit(), LiveFit()]
    try:
        assert live_fits() == before + 2
        served = [b[0] for b in loader]  # under the gate, same batches
    finally:
        for f in fits:
            f.leave()
        fits[0].leave()  # idempotent
    assert live_fits() == before
    assert all(torch.equal(a, b) for a, b in zip(served, plain)) and len(served) == 2


@pytest.mark.timeout(60)
def test_after_fit_the_users_dataloader_has_its_own_class_again():
    import lightning as L
    from torch.utils.data import DataLoader

    class Served(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            self.gated = trainer.train_dataloader is loader and getattr(loader, "_roundpipe_gated", False)

    loader, served = DataLoader(make_data(n=8), batch_size=4), Served()
    trainer = L.Trainer(strategy=RoundPipeStrategy(microbatches=2), accelerator="cpu", devices=2, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[served])
    trainer.fit(SeqModule(), loader)
    assert served.gated  # during fit: the user's own loader, gated
    assert type(loader) is DataLoader
