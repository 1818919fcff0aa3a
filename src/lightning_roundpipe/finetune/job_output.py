"""Where the fine-tuning job's text goes: through ``logging`` (so Hydra's ``<job>.log`` holds the plan
table and the summary), and user-input errors as one message on stderr instead of a traceback.

Lightning gives its loggers their own stderr handler and stops propagation when it is imported
before any logging is configured, which is the case under Hydra (Hydra configures logging only when
the job starts); ``route_lightning_logging`` hands them back to the root logger Hydra set up.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, TypeVar

from ..options import OptionError
from .checks import FineTuneInputError

log = logging.getLogger("lightning_roundpipe.finetune.job")

LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")  # each got its own stderr handler

USER_INPUT_ERRORS: tuple[type[BaseException], ...] = (FineTuneInputError, OptionError)
"""Errors whose message says what to change; shown without a traceback when the job runs from the
command line (``HYDRA_FULL_ERROR=1`` shows the traceback, as for Hydra's own errors)."""

T = TypeVar("T")


def route_lightning_logging() -> None:
    """Send Lightning's messages (the RoundPipe plan table among them) to the root logger's handlers,
    when the root logger has any (a Hydra run: console and the job's log file)."""
    if not logging.getLogger().hasHandlers():
        return
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # the one Lightning adds at import (Hydra prints instead)
                logger.removeHandler(handler)
        logger.propagate = True


def report(text: str) -> None:
    """Log ``text`` at INFO (console and log file in a Hydra run); printed when nothing would show it."""
    if logging.getLogger().hasHandlers() and log.isEnabledFor(logging.INFO):
        log.info(text)
    else:
        print(text)


def exit_on_input_error(job: Callable[[], T]) -> T:
    """Run ``job``; a user-input error prints ``error: <message>`` to stderr and exits with status 1 (as Hydra does for its own errors),
    unless ``HYDRA_FULL_ERROR=1`` asks for the traceback."""
    try:
        return job()
    except USER_INPUT_ERRORS as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {error}", file=sys.stderr)
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "error: %s", (error,), None)
        for handler in logging.getLogger().handlers:  # the job's log file keeps it too (the console is stdout)
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)
        print("Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.", file=sys.stderr)
        sys.exit(1)
