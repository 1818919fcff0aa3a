"""The error a pipelined call raises for inputs it does not take (before anything runs)."""

from __future__ import annotations


class UnsupportedInputError(ValueError):
    """A pipelined call got inputs the pipeline does not take (``inputs_embeds``, an unknown keyword,
    labels of another shape, ...); the message says what to pass instead. A ``ValueError``, as the
    builtin it replaces, so existing ``except ValueError`` code still catches it."""
