"""DHT stores that outlive their timeout: hivemind fires them as tasks that nobody awaits (a progress record,
a state donor's declaration), so each one that times out under load ends as an asyncio "Task exception was never
retrieved" block with no traceback of ours. Seen: 555 of them from a 12-peer swarm on 2 cores, for records that
the next store replaced anyway. Here each such timeout is retrieved and logged at debug level; any other exception
of those tasks still reaches the event loop's default handler.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Dict

from hivemind.optim.progress_tracker import ProgressTracker

logger = logging.getLogger(__name__)

NEVER_RETRIEVED = "Task exception was never retrieved"


def retrieve_timeout(task: asyncio.Task) -> None:
    """A done callback for a store task nobody awaits: its timeout is expected under load, and said at debug."""
    if not task.cancelled() and isinstance(task.exception(), asyncio.TimeoutError):
        logger.debug("a DHT store outlived its timeout; the next store replaces it")


def _quiet_about_late_stores(loop: asyncio.AbstractEventLoop, context: Dict[str, Any]) -> None:
    if context.get("message") == NEVER_RETRIEVED and isinstance(context.get("exception"), asyncio.TimeoutError):
        retrieve_timeout(context["future"])
        return
    loop.default_exception_handler(context)


_upstream_reporter = ProgressTracker._progress_reporter


async def quiet_progress_reporter(self: ProgressTracker) -> None:
    # the tracker runs its reporter on an event loop of its own thread (ProgressTracker.run), where no other
    # code of ours runs: its handler can take the stores it fires and never awaits
    asyncio.get_running_loop().set_exception_handler(_quiet_about_late_stores)
    await _upstream_reporter(self)


PATCHES: Dict[str, Callable] = {
    "hivemind.optim.progress_tracker.ProgressTracker._progress_reporter": quiet_progress_reporter,
}
