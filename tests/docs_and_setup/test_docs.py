"""The user guide: it builds offline with warnings as errors, its API reference follows the
package tree, every error class has a troubleshooting entry, the tutorial's code runs, and the
README keeps what a newcomer needs."""

from __future__ import annotations

import ast
import builtins
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _scripts import load_script as load_named

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PACKAGE_DIR = REPO / "src" / "lightning_roundpipe"


def load_hook():
    return load_named("docs_api_pages")


def public_modules() -> set[str]:
    names = set()
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not any(p.startswith("_") for p in parts) and parts[:1] != ("assets",):
            names.add(".".join(("lightning_roundpipe", *parts)))
    return names


def test_guide_builds_offline_with_warnings_as_errors(tmp_path):
    site = tmp_path / "site"
    dead = "http://127.0.0.1:9"  # any attempt to reach the network fails at once
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HTTP_PROXY": dead, "HTTPS_PROXY": dead,
           "http_proxy": dead, "https_proxy": dead}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(site)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "WARNING" not in done.stderr
    for page in sorted(DOCS.glob("*.md")):
        built = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), page.name
    for name in public_modules():
        built = site / "api" / Path(*name.split(".")) / "index.html"
        assert built.is_file(), name
    strategy = (site / "api/lightning_roundpipe/lightning/strategy/index.html").read_text()
    assert "RoundPipeStrategy" in strategy and "StrategyOptions" in strategy  # its docstring points to the options
    # The signature is the run-time one, one typed keyword per option, not the source's **option_values.
    signature = strategy[strategy.index("RoundPipeStrategy"):]
    assert "option_values" not in strategy
    assert "microbatches" in signature and "schedule" in signature and "Optional" in signature
    options = (site / "api/lightning_roundpipe/options/index.html").read_text()
    assert "microbatches per batch" in options  # rendered docstring of the option fields
    overview = (site / "api/index.html").read_text()
    assert "Read a trace written by" in overview or "timeline" in overview
    assert (site / "img" / "timeline.png").is_file()
    assert 'src="../img/timeline.png"' in (site / "timeline" / "index.html").read_text()


def test_api_pages_follow_the_package_tree(tmp_path):
    hook = load_hook()
    root = tmp_path / "src" / "lightning_roundpipe"
    for relative in ("__init__.py", "runtime.py", "_private.py", "engine/__init__.py", "engine/step.py",
                     "engine/_helpers.py", "sim/__init__.py", "sim/__main__.py", "assets/__init__.py"):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text('"""Docstring of %s."""\n' % relative)
    names = hook.module_names(root)
    assert names == ["lightning_roundpipe", "lightning_roundpipe.engine", "lightning_roundpipe.engine.step",
                     "lightning_roundpipe.runtime", "lightning_roundpipe.sim"]
    assert hook.nav_tree(names) == [
        {"Overview": "api/index.md"},
        {"lightning_roundpipe": "api/lightning_roundpipe.md"},
        {"runtime": "api/lightning_roundpipe/runtime.md"},
        {"sim": "api/lightning_roundpipe/sim.md"},  # a package whose only module is __main__: one page
        {"engine/": [{"(package)": "api/lightning_roundpipe/engine.md"}, {"step": "api/lightning_roundpipe/engine/step.md"}]},
    ]
    assert hook.summary(root / "engine" / "step.py") == "Docstring of engine/step.py."
    # The real tree: every public module gets a page.
    assert set(hook.module_names(PACKAGE_DIR)) == public_modules()


def error_classes() -> dict[str, Path]:
    """Exception classes defined in src, by name (a base named *Error/*Exception/*Timeout or a builtin one)."""
    builtin = {name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)}
    found: dict[str, Path] = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & builtin or any(re.search(r"(Error|Exception|Timeout)$", b) for b in bases):
                    found[node.name] = path
    return found


def test_every_error_class_has_a_troubleshooting_entry():
    classes = error_classes()
    assert {"PipelineError", "WorkerError", "PipelineTimeout", "PlanError", "MicrobatchError"} <= set(classes)
    headings = set(re.findall(r"^### (\w+)", (DOCS / "troubleshooting.md").read_text(), flags=re.M))
    missing = {name: str(path.relative_to(REPO)) for name, path in classes.items() if name not in headings}
    assert missing == {}


def test_the_tutorials_own_lightning_module_runs_as_written(tmp_path, monkeypatch):
    text = (DOCS / "tutorial.md").read_text()
    section = text.split("## 2. Through your own LightningModule", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    monkeypatch.chdir(tmp_path)  # Lightning writes lightning_logs/ here
    namespace: dict = {"__name__": "tutorial"}
    exec(compile(code, "docs/tutorial.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.global_step == 20
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    trainable = [n for n, p in trainer.lightning_module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_readme_is_short_and_keeps_what_a_newcomer_needs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    headings = re.findall(r"^## (.+)$", readme, flags=re.M)
    assert headings[:1] == ["Set-up"]  # the two commands come first
    for needed in ("Usage", "Configuration", "Reading the timeline", "Benchmarks"):
        assert needed in headings
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    assert "make run" in setup and "make test" in setup
    benchmarks = readme.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    assert "**measured**" in benchmarks and "**simulated**" in benchmarks
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO / link).is_file(), link
