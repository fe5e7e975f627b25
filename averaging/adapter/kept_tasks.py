"""Event loops that keep every task they run until it is done, in hivemind's averager and DHT processes.

asyncio's loop holds its tasks by weak reference only. hivemind creates tasks it does not keep: an averager's round
cancels its matchmaking task and drops it (DecentralizedAverager._step). That task is still unwinding: in a
`finally`, it withdraws this peer's declaration from the DHT and waits for the DHT process's reply, an MPFuture that
hivemind registers by weak reference too. Nothing else refers to that chain of tasks, so the garbage collector can
destroy it mid-await. Seen in CI: a lone peer that cancelled a round logged "Task was destroyed but it is pending!"
for the round's three matchmaking tasks, among seven ERROR lines, and its own error was one of them. A destroyed
task is also closed inside the matchmaking's locks and contexts (its declaration lock, its search), at an await in a
`finally`, where what should release them may not run.

A task factory that keeps each task in a set until it is done lets every such task finish as upstream wrote it.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Dict, Set

from hivemind.utils.asyncio import switch_to_uvloop

_running: Set[asyncio.Task] = set()  # one event loop a process: the averager's or the DHT's


def keep_until_done(loop: asyncio.AbstractEventLoop, coro, **kwargs) -> asyncio.Task:
    """A task factory: the task, held here until it is done."""
    task = asyncio.Task(coro, loop=loop, **kwargs)
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task


def loop_that_keeps_its_tasks() -> asyncio.AbstractEventLoop:
    """hivemind's switch_to_uvloop (a new uvloop event loop, made current), with keep_until_done as its factory."""
    loop = switch_to_uvloop()
    loop.set_task_factory(keep_until_done)
    return loop


PATCHES: Dict[str, Callable] = {
    "hivemind.averaging.averager.switch_to_uvloop": loop_that_keeps_its_tasks,
    "hivemind.dht.dht.switch_to_uvloop": loop_that_keeps_its_tasks,
}
