"""Teardown in steps that all run: one failing step must not leave threads, patches or pinned memory behind."""

from __future__ import annotations

import logging

log = logging.getLogger("lightning_roundpipe")


def run_all(steps) -> None:
    """Call every step in order; if any raised, raise the first error once all have run."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the remaining steps
            if first is None:
                first = exc
            else:
                log.warning("also failed during teardown: %r", exc)
    if first is not None:
        raise first
