"""Run Python code in a subprocess where the fine-tuning job's dependencies (Hydra, OmegaConf, antlr4,
datasets) cannot be imported, as on the GPU machine's image: a ``sys.meta_path`` finder answers for them
the way the import system answers for a package that is not installed (``ModuleNotFoundError``)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("hydra", "omegaconf", "antlr4", "datasets")

PRELUDE = f"""
import sys
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
sys.meta_path.insert(0, NotInstalled())
"""


def blocking_site(folder: Path) -> dict:
    """An environment whose Python processes, and every process they start, cannot import the blocked modules:
    a ``sitecustomize.py`` in ``folder`` (first on ``PYTHONPATH``) installs the finder at start-up."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(PRELUDE)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(REPO / "src"), str(REPO)]))


def run_without_job_dependencies(code: str, timeout: float = 300, args: tuple = ()) -> subprocess.CompletedProcess:
    """``code`` after the blocking prelude, in a fresh interpreter with only the repository's ``src`` and root
    on ``PYTHONPATH``; its completed process (stdout and stderr as text)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    return subprocess.run([sys.executable, "-c", PRELUDE + code, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
