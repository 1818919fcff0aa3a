"""The checks every option goes through, and their errors: ``Owner(name=value): rule``.

``owner`` and ``name`` are the option as the caller spelled it (``RoundPipeStrategy`` or
``RuntimeOptions``; ``transfer.latency_s`` for a nested group's field), so an error says what to change.
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import fields
from typing import Any, Callable, Mapping

from .errors import OptionError


def fail(owner: str, name: str, value: Any, rule: str):
    """Raise ``OptionError`` naming the option as ``owner(name=value)`` and the rule it broke."""
    raise OptionError(f"{owner}({name}={value!r}): {rule}")


def whole_number(owner: str, name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    """An ``int`` (not a bool) of at least ``minimum`` (or None where ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        fail(owner, name, value, f"must be a whole number >= {minimum}" + (" or None" if allow_none else ""))


def seconds(owner: str, name: str, value: Any, positive: bool = False, allow_none: bool = False) -> None:
    """A finite real number, > 0 where ``positive`` and >= 0 otherwise (or None where ``allow_none``)."""
    if value is None and allow_none:
        return
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
          and (value > 0 if positive else value >= 0))
    if not ok:
        fail(owner, name, value, f"must be a finite number {'> 0' if positive else '>= 0'}" + (" or None" if allow_none else ""))


def choice(owner: str, name: str, value: Any, choices) -> None:
    """One of ``choices``."""
    if value not in choices:
        fail(owner, name, value, "use one of " + ", ".join(repr(c) for c in choices))


def flag(owner: str, name: str, value: Any) -> None:
    """``True`` or ``False`` (not a truthy value)."""
    if not isinstance(value, bool):
        fail(owner, name, value, "must be True or False")


def plain(value: Any) -> Any:
    """A Hydra/OmegaConf container as plain dicts and lists (anything else unchanged). Only a process that
    imported OmegaConf can hold one, so the library never imports it itself."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is None:
        return value
    return omegaconf.OmegaConf.to_container(value, resolve=True) if omegaconf.OmegaConf.is_config(value) else value


def nested_group(cls, value: Any, owner: str, option: str, from_text: Callable[[str], Any] | None = None):
    """A nested option group given as the dataclass, a dict, a Hydra config or None (a default
    ``cls()``); a string where ``from_text`` turns one into the group (a partition policy's name)."""
    value = plain(value)
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and from_text is not None:
        return from_text(value)
    if isinstance(value, Mapping):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise OptionError(f"{owner}({option}=...): unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**value)
    raise OptionError(f"{owner}({option}=...) takes a {cls.__name__}, a dict or None, got {type(value).__name__}")
