"""Griffe extension for the API pages: show the signature a function has at run time where a
decorator writes it out, instead of the one its source spells.

``RoundPipeStrategy.__init__`` takes ``**option_values`` in its source; ``@with_option_keywords``
(``options/keywords.py``) makes it a function with one typed keyword per option: that is what
``help()``, LightningCLI and Hydra see. mkdocstrings reads the source without importing it, so
without this extension the API page would show only ``**option_values``. For each function griffe
finds decorated with ``with_option_keywords``, the extension imports it and replaces the parameters
with its ``inspect.signature``. ``mkdocs.yml`` names this file under the python handler's ``extensions``.
"""

from __future__ import annotations

import importlib
import inspect

import griffe

KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


def runtime_object(path: str):
    """The live object at a dotted ``path`` (module, then attributes), or None."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for name in parts[split:]:
                obj = getattr(obj, name)
        except AttributeError:
            return None
        return obj
    return None


def annotation_text(annotation) -> str | None:
    if annotation is inspect.Parameter.empty:
        return None
    return inspect.formatannotation(annotation)


def runtime_parameters(signature: inspect.Signature) -> griffe.Parameters:
    """Griffe's parameters for a live signature (annotations and defaults as their source text)."""
    return griffe.Parameters(*(
        griffe.Parameter(
            p.name,
            annotation=annotation_text(p.annotation),
            kind=KINDS[p.kind],
            default=None if p.default is inspect.Parameter.empty else repr(p.default),
        )
        for p in signature.parameters.values()
    ))


DECORATOR = "with_option_keywords"


class RuntimeSignatures(griffe.Extension):
    """Replace a function's parameters by its run-time signature where ``with_option_keywords`` wrote it."""

    def on_function(self, *, func: griffe.Function, **kwargs) -> None:
        if not any(DECORATOR in str(d.value) for d in func.decorators):
            return
        live = runtime_object(func.path)
        if live is None:
            return
        func.parameters = runtime_parameters(inspect.signature(live))
