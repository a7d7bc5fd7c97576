"""Background tasks of a server, stopped within a bound.

``stop_tasks`` cancels a server's background tasks and waits for them at most ``timeout_s``: a task that does
not end (one that caught its cancel, or waits on something that ignores it) is named in the log and left
behind, so that a server's stop never hangs on it. Python 3.11's ``asyncio.wait_for`` returns the result of an
inner call that finished in the same turn of the loop as the cancel, and so swallows the cancel (CPython
gh-86296, fixed in 3.12); a loop that ran such a call went on forever and held a router's stop until it was
killed. The code uses ``asyncio.timeout`` instead (a test holds that), and this bound stays for what remains.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], what: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Cancel ``tasks`` and wait up to ``timeout_s`` for them to end; those still running are logged (as
    ``what``'s) and left to end with the loop."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    _, running = await asyncio.wait(pending, timeout=timeout_s)
    if running:
        log.warning("%d of %s's background tasks did not stop within %.0f s; stopping without them: %s",
                    len(running), what, timeout_s, ", ".join(sorted(t.get_name() for t in running)))
