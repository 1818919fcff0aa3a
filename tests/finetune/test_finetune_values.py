"""Issue 20 item 16: a value of the fine-tuning job the run cannot use fails at the start,
naming its key, before any model, data or validation pass is loaded or run."""

import pytest

from lightning_roundpipe.finetune import FineTuneInputError, OptimOptions
from test_finetune_job import compose_job, load_example


@pytest.mark.parametrize("override, first_line", [
    # before: TypeError: '<' not supported between instances of 'str' and 'int' (naming no key)
    ("trainer.max_steps=abc", "trainer.max_steps='abc': must be a whole number >= 0 (-1: no limit); change it on "
                              "the command line (`python examples/finetune.py trainer.max_steps=...`)"),
    # before: torch's "Invalid learning rate: -1", after a full validation pass
    ("optim.lr=-1", "optim.lr=-1: must be a finite number > 0; change it on the command line"),
    ("optim.betas=[0.9,1.5]", "optim.betas=[0.9, 1.5]: must be two numbers in [0, 1)"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0: must be a whole number >= 1"),
    ("data.batch_size=0", "data.batch_size=0: must be a whole number >= 1"),
])
def test_a_bad_job_value_fails_first_naming_its_key(tmp_path, monkeypatch, override, first_line):
    example = load_example()

    def loads_nothing(*args, **kwargs):
        raise AssertionError("the job loaded data before checking its values")

    monkeypatch.setattr(example, "TextDataModule", loads_nothing)
    with pytest.raises(FineTuneInputError) as err:
        example.main(compose_job(override, f"out_dir={tmp_path}"))
    assert str(err.value).startswith(first_line)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_shipped_configs_pass_the_check():
    from lightning_roundpipe.finetune.config import check_job_values

    for overrides in [(), ("trainer=gpu8",), ("experiment=tiny",), ("trainer.max_steps=-1",)]:
        check_job_values(compose_job(*overrides))


def test_optim_options_refuse_a_negative_learning_rate_when_built():
    with pytest.raises(FineTuneInputError, match=r"^optim\.lr=-1: must be a finite number > 0"):
        OptimOptions.parse({"lr": -1})
