"""The library and the lab apart (issue 45 item 1): ``lightning_roundpipe`` imports nothing of ``roundpipe_lab``.

Statically (no module under ``src/lightning_roundpipe`` names the lab, lazily or not) and at run time (a
fresh process that fits a model with the strategy and runs the planner's command has no lab module
loaded). The lab's backends arrive by name only: through ``register_backend`` or an entry point, loaded
the first time its name is asked for.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "src" / "lightning_roundpipe"
LAB = "roundpipe_lab"


def lab_imports(package: Path) -> list[str]:
    """``path:line`` of every import statement under ``package`` that names the lab."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(name.split(".")[0] == LAB for name in names):
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_no_library_module_imports_the_lab():
    assert len(list(LIBRARY.rglob("*.py"))) > 100  # the library was found
    assert lab_imports(LIBRARY) == []


def test_the_scan_sees_a_lazy_import_of_the_lab(tmp_path):
    pkg = tmp_path / "lightning_roundpipe"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from roundpipe_lab.fake_cuda import pool\n")
    (pkg / "b.py").write_text("import roundpipe_lab.analysis as x\nfrom .roundpipe_lab import y\n")
    assert lab_imports(pkg) == ["lightning_roundpipe/a.py:2", "lightning_roundpipe/b.py:1"]


def run_python(code: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter on this checkout's src/ (not the installed copy), from the repository root."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


FIT_AND_PLAN = """
import contextlib, io, sys
import warnings
warnings.filterwarnings("ignore")
import lightning as L
import torch
from torch import nn
import lightning_roundpipe
from lightning_roundpipe.planning.cli import main as plan_main
from lightning_roundpipe.sim.__main__ import main as old_plan_main


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
model = Tiny()
before = [p.detach().clone() for p in model.parameters()]
trainer = L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, max_steps=2, logger=False,
                    enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
assert type(trainer.strategy).__name__ == "RoundPipeStrategy", trainer.strategy
assert trainer.global_step == 2, trainer.global_step
assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "the fit changed no weight"
out = io.StringIO()
with contextlib.redirect_stdout(out):
    fits = plan_main(["--model", "qwen3-0.6b", "--hardware", "rtx4090", "--seq-len", "512", "--gpus", "2",
                      "--no-max-seq", "--microbatches", "4"])
    old = old_plan_main(["host-bytes"])
assert fits == 0 and old == 0, (fits, old, out.getvalue())
assert "Verdict: fits" in out.getvalue(), out.getvalue()
assert "| host bytes per parameter |" in out.getvalue(), out.getvalue()
print("LAB", sorted(m for m in sys.modules if m.split(".")[0] == "roundpipe_lab"))

# Then the lab's backend by name: an entry point (a dist-info advertising it, as pyproject's do) loads it.
from lightning_roundpipe.workers import backend_class, known_backends
sys.path.insert(0, sys.argv[1])
print("KNOWN", known_backends(), "roundpipe_lab" in sys.modules)
pool = backend_class("fake_cuda")
print("LOADED", pool.__module__, pool.__name__, pool.backend, "roundpipe_lab" in sys.modules)
"""


def advertise_the_lab(folder: Path) -> Path:
    """A dist-info in ``folder`` with this checkout's ``lightning_roundpipe.backends`` entry points (pyproject's),
    as an installed checkout has them, whatever the environment's own install predates."""
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["lightning_roundpipe.backends"]
    assert table == {"fake_cuda": "roundpipe_lab.fake_cuda.pool:FakeCudaWorkerPool",
                     "emulated": "roundpipe_lab.fake_cuda.emulated:EmulatedWorkerPool"}
    info = folder / "roundpipe_lab_entry_points-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: roundpipe-lab-entry-points\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[lightning_roundpipe.backends]\n"
                                           + "".join(f"{name} = {target}\n" for name, target in table.items()))
    return folder


@pytest.mark.timeout(180)
def test_a_fit_and_a_plan_load_no_lab_module_until_a_lab_backend_is_named(tmp_path):
    run = run_python(FIT_AND_PLAN, str(advertise_the_lab(tmp_path)), timeout=170)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.strip().splitlines() if line.startswith(("LAB", "KNOWN", "LOADED")))
    assert lines["LAB"] == "[]", run.stdout[-2000:]
    assert lines["KNOWN"] == "('cpu', 'cuda', 'emulated', 'fake_cuda') False"  # named by the entry points, not loaded
    assert lines["LOADED"] == "roundpipe_lab.fake_cuda.pool FakeCudaWorkerPool fake_cuda True"


def test_an_unknown_backend_names_the_known_ones_and_the_lab():
    from lightning_roundpipe.workers.backends import BackendRegistry

    bare = BackendRegistry(group="lightning_roundpipe.no_such_group")  # as a library installed without the lab
    with pytest.raises(ValueError) as err:
        bare.pool_class("fake_cuda")
    assert str(err.value) == (
        "unknown worker backend 'fake_cuda': use one of cpu, cuda; the lab's fake drivers ('fake_cuda', 'emulated') "
        "come with this repository's second package, roundpipe_lab: install the repository (pip install -e .) or "
        "`import roundpipe_lab` first")
    assert bare.pool_class("cpu").backend == "cpu" and bare.known() == ("cpu", "cuda")


def test_registering_a_backend():
    from lightning_roundpipe.workers import CpuWorkerPool, backend_class, register_backend
    from roundpipe_lab.backends import LAB_BACKENDS, register_lab_backends

    register_lab_backends()  # again: the same classes, a no-op
    assert {name: backend_class(name) for name in LAB_BACKENDS} == LAB_BACKENDS
    with pytest.raises(ValueError, match="^worker backend 'fake_cuda' is registered already, as "
                                         "roundpipe_lab.fake_cuda.pool.FakeCudaWorkerPool$"):
        register_backend("fake_cuda", CpuWorkerPool)
    with pytest.raises(ValueError, match="'cuda' is built into lightning_roundpipe"):
        register_backend("cuda", CpuWorkerPool)
    with pytest.raises(TypeError, match="needs a WorkerPool subclass"):
        register_backend("mine", object)
    with pytest.raises(ValueError, match=r"unknown worker backend 'nope': use one of cpu, cuda, emulated, fake_cuda$"):
        backend_class("nope")
