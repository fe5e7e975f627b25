"""Start hivemind's DHT from a DHTConfig, with retries, and shut it down quietly.

The p2p daemon sometimes needs more than its default 15 s to start, and initial peers are
sometimes unreachable for a while, so start-up is retried with exponential backoff. When
retries run out, the error is one line naming every address tried and the last cause.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional, Sequence

import hivemind

from dht.config import DHTConfig

logger = logging.getLogger(__name__)


class DHTStartError(RuntimeError):
    """The DHT could not start or reach any initial peer; the message is one line."""


def start_dht(
    config: DHTConfig,
    *,
    record_validators: Sequence = (),
    identity_path: Optional[str] = None,
    sleep: Callable[[float], None] = time.sleep,
    first_backoff_seconds: float = 1.0,
) -> hivemind.DHT:
    """Start a DHT node; retry with exponential backoff; raise DHTStartError when out of attempts."""
    last_error: Optional[BaseException] = None
    backoff = first_backoff_seconds
    for attempt in range(1, config.startup_attempts + 1):
        try:
            return hivemind.DHT(
                initial_peers=list(config.initial_peers) or None,
                host_maddrs=list(config.host_maddrs),
                announce_maddrs=list(config.announce_maddrs) or None,
                client_mode=config.client_mode,
                record_validators=record_validators,
                startup_timeout=config.startup_timeout_seconds,
                identity_path=identity_path,
                start=True,
                await_ready=True,
            )
        except Exception as e:  # hivemind raises P2PDaemonError, RuntimeError, TimeoutError, ...
            last_error = e
            if attempt < config.startup_attempts:
                logger.warning(
                    f"DHT start attempt {attempt}/{config.startup_attempts} failed ({_one_line(e)}); "
                    f"retrying in {backoff:.0f}s"
                )
                sleep(backoff)
                backoff *= 2
    tried = ", ".join(config.initial_peers) if config.initial_peers else "no initial peers"
    raise DHTStartError(
        f"could not join the swarm after {config.startup_attempts} attempts "
        f"(initial peers tried: {tried}; listening on {', '.join(config.host_maddrs)}); "
        f"last error: {_one_line(last_error)}; check that an initial peer is running and reachable, "
        f"or raise --startup-attempts / --startup-timeout-seconds"
    )


def visible_maddrs(dht: hivemind.DHT) -> List[str]:
    """Addresses another machine can pass to --initial-peers, loopback last."""
    maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
    return sorted(maddrs, key=lambda maddr: ("/ip4/127." in maddr or "/ip6/::1/" in maddr, maddr))


async def _silence_hivemind_logs(dht, node) -> None:
    """Runs inside the DHT process (see quiet_dht_logs)."""
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)


def quiet_dht_logs(dht: Optional[hivemind.DHT], timeout_seconds: float = 5.0) -> None:
    """Before leaving: the DHT process logs pipe errors while its siblings exit; they mean nothing to users."""
    if dht is None or not dht.is_alive():
        return
    try:
        dht.run_coroutine(_silence_hivemind_logs, return_future=True).result(timeout_seconds)
    except Exception as e:
        logger.debug(f"could not quiet the DHT process's logs: {e!r}")


def shutdown_dht(dht: Optional[hivemind.DHT], timeout_seconds: float = 10.0) -> None:
    """Stop the DHT process and its p2p daemon, with a bounded wait and no traceback for the user."""
    if dht is None or not dht.is_alive():
        return
    try:
        dht.shutdown()
        dht.join(timeout_seconds)
    except Exception as e:  # hivemind's shutdown can fail noisily once the peer is already half gone
        logger.debug(f"DHT shutdown raised {_one_line(e)}")
    if dht.is_alive():
        logger.warning(f"DHT process did not exit within {timeout_seconds:.0f}s; terminating it")
        dht.terminate()
        dht.join(timeout_seconds)


def _one_line(error: Optional[BaseException]) -> str:
    if error is None:
        return "unknown error"
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text}"[:400]
