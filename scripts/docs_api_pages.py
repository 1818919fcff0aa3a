"""MkDocs hook: one API reference page per module of ``src/lightning_roundpipe``, made at build time.

``mkdocs.yml`` names this file under ``hooks:``. The pages are not kept in ``docs/``: each build
walks the package, writes a page per module holding mkdocstrings' ``::: module`` directive (the
python handler renders the docstrings), an overview page listing every module with the first
line of its docstring, and fills the ``API reference`` entry of the navigation. A module someone
adds, moves or renames appears without editing the docs; private modules (``_name.py``) and
``__main__`` are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mkdocs.structure.files import File

PACKAGE = "lightning_roundpipe"
NAV_TITLE = "API reference"
API_DIR = "api"


def package_root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent / "src" / PACKAGE


def module_names(root: Path) -> list[str]:
    """Dotted names of the public modules under ``root``, packages before their modules."""
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(part.startswith("_") for part in parts) or "assets" in parts[:1]:
            continue
        names.append(".".join((PACKAGE, *parts)))
    return sorted(names, key=lambda name: name.split("."))


def source_of(root: Path, name: str) -> Path:
    relative = Path(*name.split(".")[1:])
    package = root / relative / "__init__.py"
    return package if package.exists() else (root / relative).with_suffix(".py")


def summary(path: Path) -> str:
    """The first line of a module's docstring ('' when it has none)."""
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    return docstring.strip().splitlines()[0] if docstring else ""


def page_uri(name: str) -> str:
    return f"{API_DIR}/{name.replace('.', '/')}.md" if name != PACKAGE else f"{API_DIR}/{PACKAGE}.md"


def nav_tree(names: list[str]) -> list:
    """``[overview, package, {folder: [module pages]}, ...]`` for the navigation."""
    tree: list = [{"Overview": f"{API_DIR}/index.md"}, {PACKAGE: page_uri(PACKAGE)}]
    folders: dict[str, list] = {}
    for name in names[1:]:
        parts = name.split(".")
        if len(parts) == 2 and not any(n.startswith(name + ".") for n in names):  # a module, or a package alone
            tree.append({parts[1]: page_uri(name)})
            continue
        folders.setdefault(parts[1], []).append({".".join(parts[2:]) or "(package)": page_uri(name)})
    tree.extend({f"{folder}/": pages} for folder, pages in folders.items())
    return tree


def on_config(config):
    names = module_names(package_root(config))
    for index, entry in enumerate(config["nav"]):
        if isinstance(entry, dict) and NAV_TITLE in entry:
            config["nav"][index] = {NAV_TITLE: nav_tree(names)}
            return config
    config["nav"].append({NAV_TITLE: nav_tree(names)})
    return config


def on_files(files, config):
    root = package_root(config)
    names = module_names(root)
    lines = [
        "# API reference",
        "",
        "Generated at build time from the docstrings of every public module (`scripts/docs_api_pages.py`).",
        "Start with [`RoundPipeStrategy`](lightning_roundpipe/lightning/strategy.md) (Lightning) or",
        "[`RoundPipeRuntime`](lightning_roundpipe/runtime.md) (plain PyTorch).",
        "",
        "| module | what it holds |",
        "|---|---|",
    ]
    for name in names:
        link = page_uri(name)[len(API_DIR) + 1:]
        lines.append(f"| [`{name}`]({link}) | {summary(source_of(root, name)).replace('|', '/')} |")
        files.append(File.generated(config, page_uri(name), content=f"# `{name}`\n\n::: {name}\n"))
    files.append(File.generated(config, f"{API_DIR}/index.md", content="\n".join(lines) + "\n"))
    return files
