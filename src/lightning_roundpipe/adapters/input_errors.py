"""The error a pipelined call raises for inputs it does not take (before anything runs); defined in ``errors.py``."""

from __future__ import annotations

from ..errors import UnsupportedInputError
