"""averaging/adapter/kept_tasks.py: a task that nobody keeps, awaiting a reply registered by weak reference (as
hivemind's matchmaking awaits the DHT), is destroyed by the garbage collector on a plain event loop and finishes on
one whose task factory keeps it."""
from __future__ import annotations

import asyncio
import gc
import weakref
from typing import List, Optional

import hivemind.averaging.averager
import hivemind.dht.dht
import uvloop

from averaging import adapter
from averaging.adapter.kept_tasks import keep_until_done, loop_that_keeps_its_tasks


def unwind_a_dropped_task(task_factory: Optional[object]) -> List[str]:
    """What became of a task that its creator dropped while it waited for a reply: 'finished', or what the loop
    reported."""
    loop, happened = uvloop.new_event_loop(), []
    loop.set_exception_handler(lambda loop, context: happened.append(context["message"]))
    if task_factory is not None:
        loop.set_task_factory(task_factory)
    replies = {}  # like hivemind's MPFuture registry: weak references to the replies still awaited

    async def withdraw_declaration() -> None:  # like matchmaking's `finally`, after its round was cancelled
        reply = loop.create_future()
        replies["reply"] = weakref.ref(reply)
        await reply
        happened.append("finished")

    async def round_that_drops_it() -> None:
        asyncio.ensure_future(withdraw_declaration())  # as DecentralizedAverager._step drops its matchmaking task
        await asyncio.sleep(0)  # it now waits for its reply
        gc.collect()
        reply = replies["reply"]()
        if reply is not None:
            reply.set_result(None)
        await asyncio.sleep(0.01)

    try:
        loop.run_until_complete(round_that_drops_it())
    finally:
        loop.close()
    gc.collect()
    return happened


def test_a_dropped_task_waiting_for_a_reply_is_destroyed_on_a_plain_loop():
    assert unwind_a_dropped_task(None) == ["Task was destroyed but it is pending!"]


def test_the_task_factory_keeps_it_until_it_finishes():
    assert unwind_a_dropped_task(keep_until_done) == ["finished"]


def test_the_averagers_and_the_dhts_processes_make_their_loops_with_it():
    adapter.install()
    assert hivemind.averaging.averager.switch_to_uvloop is loop_that_keeps_its_tasks
    assert hivemind.dht.dht.switch_to_uvloop is loop_that_keeps_its_tasks
