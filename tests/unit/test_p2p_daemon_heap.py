"""The p2pd a peer starts collects its garbage at GOGC=50, unless the environment names a GOGC
(peer/process/p2p_daemon_heap.py)."""
from __future__ import annotations

from tests.new_process import environment_without, python_result

CHECK = """
import asyncio, json, psutil
from peer.process.p2p_daemon_heap import bound_p2p_daemon_heap
bound_p2p_daemon_heap()
from hivemind.p2p import P2P

async def main():
    p2p = await P2P.create()
    try:
        (daemon,) = [child for child in psutil.Process().children() if child.name() == "p2pd"]
        print(json.dumps(daemon.environ().get("GOGC")))
    finally:
        await p2p.shutdown()

asyncio.run(main())
"""


def gc_percent_of_the_daemon(env: dict) -> str:
    return python_result(CHECK, env=env)


def without_gogc() -> dict:
    return environment_without(["GOGC"])


def test_the_daemon_collects_at_half_of_gos_default():
    assert gc_percent_of_the_daemon(without_gogc()) == "50"


def test_a_gogc_the_user_set_stands():
    assert gc_percent_of_the_daemon({**without_gogc(), "GOGC": "200"}) == "200"
