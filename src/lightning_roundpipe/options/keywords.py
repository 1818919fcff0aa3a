"""A constructor's keyword options written out from an options dataclass, so its signature is real.

``with_option_keywords(StrategyOptions)`` turns ``def __init__(self, options=None, *, ...,
**option_values)`` into a function taking one typed keyword per field, its default and type taken
from the dataclass: what ``help()``, IDEs, Hydra and LightningCLI (jsonargparse) read. It is
generated the way ``dataclasses`` generates an ``__init__`` and passes on only the keywords the
caller set. ``RefusesUnknownKeywords`` turns a keyword the constructor does not take into an error
that says what to write (``refuse_unknown_options``), instead of Python's bare ``TypeError``.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import fields

from .strategy import refuse_unknown_options


def with_option_keywords(options_class, skip=()):
    """Decorator: ``method``'s parameters but its ``**option_values``, then one keyword-only parameter per
    field of ``options_class`` not in ``skip``; ``method`` gets the set ones as ``**option_values``."""

    def wrap(method):
        hints = typing.get_type_hints(method)
        option_hints = typing.get_type_hints(options_class)
        defaults = options_class()
        namespace = {"_method": method}
        positional, keyword, passed = [], [], []

        def parameter(name: str, annotation, default) -> str:
            text = name
            if annotation is not inspect.Parameter.empty:
                namespace[f"_type_{name}"] = annotation
                text += f": _type_{name}"
            if default is not inspect.Parameter.empty:
                namespace[f"_default_{name}"] = default
                text += f" = _default_{name}"
            return text

        for p in inspect.signature(method).parameters.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                continue
            text = parameter(p.name, hints.get(p.name, inspect.Parameter.empty), p.default)
            if p.kind is inspect.Parameter.KEYWORD_ONLY:
                keyword.append(text)
                passed.append(f"{p.name}={p.name}")
            else:
                positional.append(text)
                passed.append(p.name)
        options = [f.name for f in fields(options_class) if f.name not in skip and f.init]
        keyword += [parameter(name, option_hints[name], getattr(defaults, name)) for name in options]
        body = [f"    if {name} is not _default_{name}: _given[{name!r}] = {name}" for name in options]
        source = "\n".join([f"def {method.__name__}({', '.join(positional + ['*'] + keyword)}):",
                            "    _given = {}", *body,
                            f"    return _method({', '.join(passed)}, **_given)"])
        # The dataclasses way: a real signature, not a patched one (annotations as objects: no inherited
        # ``from __future__ import annotations``).
        exec(compile(source, f"<option keywords of {options_class.__name__}>", "exec", dont_inherit=True), namespace)
        function = namespace[method.__name__]
        function.__module__, function.__qualname__ = method.__module__, method.__qualname__
        function.__doc__ = method.__doc__  # (no functools.wraps: its __wrapped__ would make inspect show ``method``)
        function.option_keywords = tuple(options)  # what an unknown keyword's error lists
        return function

    return wrap


class RefusesUnknownKeywords:
    """Base of a class whose ``__init__`` takes option keywords: before it is constructed, a keyword its
    ``__init__`` does not take is refused with what to write instead (``refuse_unknown_options``)."""

    def __new__(cls, *args, **kwargs):
        taken = inspect.signature(cls.__init__).parameters
        unknown = {name: value for name, value in kwargs.items() if name not in taken}
        if unknown:
            refuse_unknown_options(cls.__name__, unknown, set(getattr(cls.__init__, "option_keywords", taken)))
        return super().__new__(cls)
