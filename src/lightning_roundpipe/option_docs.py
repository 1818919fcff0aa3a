"""What each option means, read from the option dataclasses' docstrings (their only description).

The dataclasses of the ``options`` package describe their fields in their docstrings, one entry per field
(``name: what it does``, continued on lines indented deeper; fields that share a text are named
together, ``a / b:`` or ``a, b:``). This module reads those entries back, so that the options
table of the docs (``docs/options.md``, written by ``scripts/options_table.py``) and the
``Args:`` section LightningCLI shows for ``--trainer.strategy.help`` come from the same text.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

from . import options as option_classes

# ``name: text`` / ``a / b: text`` / ``a, b, c: text`` at the docstring's own indentation.
ENTRY = re.compile(r"^(?P<names>[a-z_][a-z0-9_]*(?:\s*(?:/|,)\s*[a-z_][a-z0-9_]*)*):\s+(?P<text>.*)$")

# The tables of docs/options.md, in the order a user meets them: (title, option class).
TABLES = (
    ("`RoundPipeStrategy(...)` (`StrategyOptions`; `RuntimeOptions` without the last four)",
     option_classes.StrategyOptions),
    ("`partition=...` (`PartitionConfig`, Hydra group `partition`)", option_classes.PartitionConfig),
    ("`transfer=...` (`TransferConfig`, Hydra group `transfer`)", option_classes.TransferConfig),
    ("`testing=...` (`TestingOptions`: delays for tests and measurements, not for training)",
     option_classes.TestingOptions),
)


def field_descriptions(cls) -> dict[str, str]:
    """``{field name: its description}`` from the docstrings of ``cls`` and its option bases, each
    description joined into one line; a field the docstrings do not name is left out."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (klass.__module__ + ".").startswith(option_classes.__name__ + "."):
            continue
        found.update(_entries(inspect.cleandoc(klass.__doc__ or "")))
    known = {f.name for f in dataclasses.fields(cls)}
    return {name: text for name, text in found.items() if name in known}


def _entries(doc: str) -> dict[str, str]:
    entries: dict[str, str] = {}
    names: list[str] = []
    for line in doc.splitlines():
        match = ENTRY.match(line)
        if match:
            names = re.split(r"\s*(?:/|,)\s*", match["names"])
            for name in names:
                entries[name] = match["text"].strip()
        elif line.startswith(" ") and names:  # a continuation line of the entry above
            for name in names:
                entries[name] += " " + line.strip()
        else:
            names = []
    return entries


def type_name(annotation) -> str:
    """``Optional[int]`` for ``typing.Optional[int]``, ``float`` for ``float``: short and readable."""
    if isinstance(annotation, type):
        return annotation.__name__
    return re.sub(r"\b(?:typing|lightning_roundpipe\.options(?:\.\w+)?)\.", "", str(annotation))


def option_rows(cls) -> list[tuple[str, str, str, str]]:
    """``(name, type, default, description)`` for each field of ``cls``."""
    hints = typing.get_type_hints(cls)
    described = field_descriptions(cls)
    defaults = cls()
    rows = []
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name)
        shown = f"{type(default).__name__}()" if dataclasses.is_dataclass(default) else repr(default)
        rows.append((f.name, type_name(hints[f.name]), shown, described.get(f.name, "")))
    return rows


def args_section(cls, skip=()) -> str:
    """A Google-style ``Args:`` section of ``cls``'s fields, for the docstring of a function whose
    keyword arguments they are (jsonargparse, and so LightningCLI's help, reads it)."""
    described = field_descriptions(cls)
    lines = ["Args:"]
    for f in dataclasses.fields(cls):
        if f.name not in skip:
            lines.append(f"    {f.name}: {described.get(f.name, '')}")
    return "\n".join(lines)
