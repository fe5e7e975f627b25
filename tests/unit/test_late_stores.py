"""averaging/adapter/late_stores.py: a DHT store that times out in a task nobody awaits is retrieved quietly; any
other failure of such a task still reaches the event loop's handler."""
from __future__ import annotations

import asyncio
import gc
from typing import List

from averaging.adapter.late_stores import NEVER_RETRIEVED, _quiet_about_late_stores, retrieve_timeout


async def _fails() -> None:
    raise RuntimeError("not a timeout")


def run_fire_and_forget(loop: asyncio.AbstractEventLoop, with_callback: bool) -> None:
    async def fire() -> None:
        store = asyncio.create_task(asyncio.wait_for(asyncio.sleep(10), timeout=0.01))
        if with_callback:
            store.add_done_callback(retrieve_timeout)
        asyncio.create_task(_fails())
        await asyncio.sleep(0.1)

    loop.run_until_complete(fire())
    gc.collect()  # the loop reports a never-retrieved exception when the finished task is collected


def reported_by(handler_for) -> List[str]:
    loop, reported = asyncio.new_event_loop(), []
    try:
        loop.default_exception_handler = lambda context: reported.append(repr(context.get("exception")))
        handler_for(loop, reported)
    finally:
        loop.close()
    gc.collect()
    return reported


def test_a_timed_out_store_with_the_callback_is_retrieved_and_a_real_failure_still_reported():
    reported = reported_by(lambda loop, reported: run_fire_and_forget(loop, with_callback=True))
    assert reported == ["RuntimeError('not a timeout')"]


def test_the_trackers_loop_handler_takes_timed_out_stores_only():
    def with_handler(loop, reported):
        loop.set_exception_handler(_quiet_about_late_stores)
        run_fire_and_forget(loop, with_callback=False)

    assert reported_by(with_handler) == ["RuntimeError('not a timeout')"]


def test_without_either_both_are_reported():
    def plain(loop, reported):
        loop.set_exception_handler(lambda loop, context: reported.append(context["message"]))
        run_fire_and_forget(loop, with_callback=False)

    assert reported_by(plain) == [NEVER_RETRIEVED, NEVER_RETRIEVED]
