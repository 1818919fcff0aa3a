"""What the README and the timeline page call a healthy timeline is what the default job draws:
it clips gradients, so its layers cannot step during backward, and the pages say so."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir

from lightning_roundpipe.lightning.early_steps import early_steps_allowed

REPO = Path(__file__).resolve().parents[2]


def default_job_clip() -> float | None:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config").trainer.gradient_clip_val


def layers_may_step_during_backward(gradient_clip_val) -> bool:
    trainer = SimpleNamespace(gradient_clip_val=gradient_clip_val, callbacks=[])
    return early_steps_allowed(trainer, pl.LightningModule(), SimpleNamespace(scaler=None))


@pytest.mark.timeout(60)
def test_the_default_job_clips_so_its_optimizer_runs_after_backward():
    clip = default_job_clip()
    assert clip == 1.0
    assert not layers_may_step_during_backward(clip)
    assert layers_may_step_during_backward(None)  # what trainer.gradient_clip_val=null gives


@pytest.mark.timeout(60)
def test_the_readme_and_timeline_page_describe_the_default_jobs_optimizer_bars():
    clip = default_job_clip()
    readme = " ".join((REPO / "README.md").read_text().split())
    timeline = " ".join((REPO / "docs" / "timeline.md").read_text().split())
    for page in (readme, timeline):
        assert f"gradient_clip_val: {clip}" in page
        assert "trainer.gradient_clip_val=null" in page
        assert not re.search(r"optim\S* bars under the next", page)  # the claim the default job disproves
    assert "`optimizer hidden` reads 0%" in readme
    assert "clipping needs the global norm of the whole gradient first" in readme
