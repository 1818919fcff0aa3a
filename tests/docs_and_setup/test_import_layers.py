"""The layout is the architecture: every package imports only what docs/design.md's "Where things live" allows.

The allowed imports are read from that section's table, so the page and this test cannot drift
apart. Imports are read with ``ast`` from every module of ``src/lightning_roundpipe`` (those inside
functions too, so a lazy import cannot hide an arrow). A package's ``__main__.py`` is a command,
not a layer (nothing imports it): it may reach any layer, as ``python -m lightning_roundpipe.sim``
reaches ``planning``. The lab (``src/roundpipe_lab``) is outside the package: test_library_imports_no_lab.py.

Run as a script to print the figures of issue 21 for a source tree:
``python tests/docs_and_setup/test_import_layers.py [SRC_DIR]`` prints the import arrows that point up the
model stack (schedule < cost < sim < planning) and the package cycles.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "lightning_roundpipe"
MODEL_STACK = ("schedule", "cost", "sim", "planning")  # bottom to top (the lab's analysis sits above, outside)
ROOT = "(root)"  # the package's own __init__.py


def part_of(module: str) -> str:
    """The package (or top-level module) a dotted module name belongs to: ``lightning_roundpipe.sim.simulate`` -> ``sim``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def module_imports(src: Path) -> dict[str, set[str]]:
    """Each module of the package (dotted name) and the modules of the package it imports."""
    out: dict[str, set[str]] = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        rel = path.relative_to(src).with_suffix("").parts
        is_package = rel[-1] == "__init__"
        module = ".".join(rel[:-1] if is_package else rel)
        here = module.split(".") if is_package else module.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != PACKAGE:
                    continue
                if node.module is None or target == PACKAGE:  # ``from .. import assets``: the names are modules
                    targets |= {f"{target}.{a.name}" for a in node.names}
                else:
                    targets.add(target)
        out[module] = targets
    return out


def package_arrows(src: Path) -> dict[tuple[str, str], set[str]]:
    """``(from_part, to_part) -> {importing modules}`` between different parts, commands left out."""
    arrows: dict[tuple[str, str], set[str]] = defaultdict(set)
    for module, targets in module_imports(src).items():
        if module.endswith(".__main__"):
            continue
        for target in targets:
            a, b = part_of(module), part_of(target)
            if a != b:
                arrows[(a, b)].add(module)
    return dict(arrows)


def upward_arrows(arrows) -> list[tuple[str, str]]:
    """Package arrows from a lower to a higher layer of the model stack."""
    rank = {name: i for i, name in enumerate(MODEL_STACK)}
    return sorted((a, b) for a, b in arrows if a in rank and b in rank and rank[b] > rank[a])


def package_cycles(arrows) -> list[list[str]]:
    """The strongly connected groups of more than one package (Tarjan's algorithm)."""
    graph = defaultdict(set)
    for a, b in arrows:
        graph[a].add(b)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(set(graph) | {b for bs in graph.values() for b in bs}):
        if v not in index:
            visit(v)
    return sorted(groups)


def module_pairs_importing_each_other(imports: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of modules of the package that import each other (a two-file cycle), sorted."""
    return sorted({tuple(sorted((a, b))) for a, targets in imports.items() for b in targets
                   if b != a and a in imports.get(b, ())})


def documented_layers(design: Path = REPO / "docs" / "design.md") -> dict[str, set[str]]:
    """The "Where things live" table: each package (or top-level module) and what it may import."""
    text = design.read_text()
    section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    allowed = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`").removesuffix("/").removesuffix(".py")
        may = cells[2]
        allowed[ROOT if name == "__init__" else name] = {"anything"} if may == "anything" else set(re.findall(r"`([a-z_]+)`", may))
    return allowed


def parts_of_tree(src: Path) -> set[str]:
    return {part_of(m) for m in module_imports(src)}


SRC = REPO / "src"


def test_every_package_and_top_level_module_is_in_the_table():
    layers = documented_layers()
    assert parts_of_tree(SRC) == set(layers), "docs/design.md 'Where things live' must list every part of the package"
    for name, allowed in layers.items():
        assert allowed <= set(layers) | {"anything"}, f"{name} may import unknown parts {allowed - set(layers)}"


def test_each_package_imports_only_what_the_table_allows():
    layers = documented_layers()
    wrong = [f"{module} ({a}) imports {b}" for (a, b), modules in package_arrows(SRC).items()
             if "anything" not in layers[a] and b not in layers[a] for module in sorted(modules)]
    assert wrong == []


def test_no_arrow_points_up_the_model_stack_and_no_packages_import_each_other():
    arrows = package_arrows(SRC)
    assert upward_arrows(arrows) == []
    assert package_cycles(arrows) == []


def test_no_two_modules_import_each_other():
    # Issue 45: a pair that imports each other (even lazily, inside a function) shares a piece that
    # belongs below both (cost/model_shape.py, cost/layer_costs.py, schedule/graph_task.py).
    assert module_pairs_importing_each_other(module_imports(SRC)) == []


def test_the_pair_count_sees_a_lazy_two_file_cycle(tmp_path):
    pkg = tmp_path / PACKAGE
    for rel, body in {"__init__.py": "", "cost/__init__.py": "",
                      "cost/profile.py": "def f():\n    from .view import V\n",
                      "cost/view.py": "from .profile import f\nV = 1\n",
                      "cost/memory.py": "from .view import V\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(body)
    assert module_pairs_importing_each_other(module_imports(tmp_path)) == [
        (f"{PACKAGE}.cost.profile", f"{PACKAGE}.cost.view")]


def test_no_module_imports_by_name_at_run_time():
    # A lazy loader (``importlib.import_module``, a module-level ``__getattr__``) hides arrows from
    # the count above, as sim/__init__.py's once hid the sim <-> planning cycle.
    hidden = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute))}
        if names & {"import_module", "__import__"} or any(
                isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
            hidden.append(str(path.relative_to(SRC)))
    assert hidden == []


def test_the_counts_see_an_upward_arrow_and_a_cycle(tmp_path):
    # The counting itself, on a tree made to break both rules (cost -> sim -> cost, lazily imported).
    pkg = tmp_path / PACKAGE
    for rel, body in {"__init__.py": "", "cost/__init__.py": "", "sim/__init__.py": "",
                      "cost/transformer.py": "def f():\n    from ..sim.hardware import X\n",
                      "sim/hardware.py": "from ..cost import transformer\nX = 1\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(body)
    arrows = package_arrows(tmp_path)
    assert upward_arrows(arrows) == [("cost", "sim")]
    assert package_cycles(arrows) == [["cost", "sim"]]


def test_the_old_simulator_command_reaches_the_planner_through_its_main_only():
    imports = module_imports(SRC)
    assert imports[f"{PACKAGE}.sim.__main__"] == {f"{PACKAGE}.planning.cli"}
    assert imports[f"{PACKAGE}.plan"] == {f"{PACKAGE}.planning.cli"}
    reaching = sorted(m for m, targets in imports.items() if f"{PACKAGE}.planning.cli" in targets)
    assert reaching == [f"{PACKAGE}.plan", f"{PACKAGE}.sim.__main__"]  # the two commands, nothing in the training path


if __name__ == "__main__":
    tree = Path(sys.argv[1]) if len(sys.argv) > 1 else SRC
    found = package_arrows(tree)
    up, cycles = upward_arrows(found), package_cycles(found)
    print(f"import arrows pointing up ({' < '.join(MODEL_STACK)}): {len(up)} {up}")
    for a, b in up:
        print(f"  {a} -> {b}: {', '.join(sorted(found[(a, b)]))}")
    print(f"package cycles: {len(cycles)} {cycles}")
    pairs = module_pairs_importing_each_other(module_imports(tree))
    print(f"modules importing each other: {len(pairs)} {pairs}")
