"""The logger tasks write to: the Prefect run's when there is one, a plain one otherwise."""

from __future__ import annotations

import logging
from typing import Any


def run_logger() -> logging.Logger | logging.LoggerAdapter[Any]:
    """The current Prefect run's logger, or the 'shardline' logger when a task's function is called directly.

    Prefect is imported here, not with the module: `batch run`'s checks in the command (``tasks/batch_admission``,
    through ``tasks/fairness``) run without it."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("shardline")
