"""Count the public objects of the API reference that have no docstring.

    python scripts/docstring_coverage.py            # the count, then every undocumented name
    python scripts/docstring_coverage.py --summary  # the count only

Public objects are what the API pages (``scripts/docs_api_pages.py``) show: every public module,
and in it every class, function and method whose name has no leading underscore (methods of
public classes, nested classes included). The source is read, not imported, as mkdocstrings
reads it. One kind of method needs no docstring of its own: an override (marked ``@override``
or not) of a method its base class documents: a base outside this package (``nn.Module.forward``,
``torch.autograd.Function.backward``, Lightning's hooks, ``io.RawIOBase.read``) or one of ours
whose method has a docstring. Its contract is the base's, and ``help()`` shows the base's text
(the modules are imported to see the bases).
``tests/docs_and_setup/test_api_reference.py`` keeps the count at zero.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _api_pages():
    spec = importlib.util.spec_from_file_location("docs_api_pages", ROOT / "scripts" / "docs_api_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _is_override(node) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "override") or (isinstance(d, ast.Attribute) and d.attr == "override")
               for d in node.decorator_list)


def _documented_in_base(owner, name: str, package: str) -> bool:
    """Whether class ``owner`` overrides ``name`` of a base that documents it: any base outside
    ``package``, or one of ours whose own ``name`` has a docstring."""
    if not isinstance(owner, type):
        return False
    for base in owner.__mro__[1:]:
        if name in vars(base):
            return not base.__module__.startswith(package) or bool(getattr(vars(base)[name], "__doc__", None))
    return False


def public_objects(package: Path | None = None) -> list[tuple[str, bool]]:
    """``(dotted name, has a docstring)`` for every public object of the API pages' modules."""
    pages = _api_pages()
    package = package or ROOT / "src" / pages.PACKAGE
    found: list[tuple[str, bool]] = []

    def visit(body, prefix: str, owner) -> None:
        for node in body:
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            name = f"{prefix}.{node.name}"
            if owner is None or not (_is_override(node) or _documented_in_base(owner, node.name, pages.PACKAGE)):
                found.append((name, ast.get_docstring(node) is not None))
            if isinstance(node, ast.ClassDef):
                scope = importlib.import_module(prefix) if owner is None else owner
                visit(node.body, name, getattr(scope, node.name, object))

    for module in pages.module_names(package):
        tree = ast.parse(pages.source_of(package, module).read_text(encoding="utf-8"))
        found.append((module, ast.get_docstring(tree) is not None))
        visit(tree.body, module, None)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", action="store_true", help="print the count only")
    args = parser.parse_args(argv)
    objects = public_objects()
    missing = [name for name, documented in objects if not documented]
    print(f"{len(missing)} of {len(objects)} public objects have no docstring")
    if not args.summary:
        print("\n".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
