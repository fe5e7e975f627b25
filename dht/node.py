"""Start hivemind's DHT from a DHTConfig, with retries, and shut it down quietly.

The p2p daemon sometimes needs more than its default 15 s to start, and initial peers are
sometimes unreachable for a while, so start-up is retried with exponential backoff. When
retries run out, the error is one line naming every address tried and the last cause.
With --identity, the key file is created or validated here, before p2pd sees it.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import hivemind
import psutil
from hivemind.dht.protocol import MAX_DHT_TIME_DISCREPANCY_SECONDS
from hivemind.dht.validation import CompositeValidator

from dht.config import DHTConfig
from dht.identity import IdentityError, IdentityInUse, ensure_identity, is_private, lock_identity
from dht.sockets import use_private_socket_dir
from dht.verdicts import RememberingValidator

logger = logging.getLogger(__name__)


READY_POLL_SECONDS = 0.5


def remember_valid_records(dht: hivemind.DHT, record_validators: Sequence) -> None:
    """Give a DHT that has not started yet a validator that checks each valid record once (dht/verdicts.py)."""
    if not isinstance(getattr(dht, "_record_validator", None), CompositeValidator) or dht.is_alive():
        raise RuntimeError("hivemind.DHT no longer keeps its validators in _record_validator before it starts: "
                           "see dht/verdicts.py")
    dht._record_validator = RememberingValidator(record_validators)


class DHTStartError(RuntimeError):
    """The DHT could not start or reach any initial peer; the message is one line."""


class DHTStartCancelled(DHTStartError):
    """A stop was requested while the DHT was starting."""


def start_dht(
    config: DHTConfig,
    *,
    record_validators: Sequence = (),
    identity_path: Optional[str] = None,
    sleep: Callable[[float], None] = time.sleep,
    first_backoff_seconds: float = 1.0,
    cancelled: Callable[[], bool] = lambda: False,
) -> hivemind.DHT:
    """Start a DHT node; retry with exponential backoff; raise DHTStartError when out of attempts.

    Each attempt (p2pd start-up plus reaching an initial peer) is bounded by
    config.startup_timeout_seconds, so the whole call takes at most about
    startup_attempts * startup_timeout_seconds plus the backoff between attempts.
    Once cancelled() is true (a stop signal), it gives up within READY_POLL_SECONDS
    and raises DHTStartCancelled.

    :param identity_path: key file for a stable peer ID; default: config.identity
    """
    use_private_socket_dir()
    identity = identity_path if identity_path is not None else config.identity
    if identity is not None:
        try:
            peer_id = ensure_identity(Path(identity))
            lock_identity(Path(identity))
        except IdentityInUse:
            raise
        except IdentityError as e:
            raise DHTStartError(str(e)) from e
        if not is_private(Path(identity)):
            logger.warning(f"identity file {identity} is readable by other users; run: chmod 600 {identity}")
        logger.info(f"peer id {peer_id} from identity file {identity}")

    last_error: Optional[BaseException] = None
    backoff = first_backoff_seconds
    for attempt in range(1, config.startup_attempts + 1):
        if cancelled():
            raise DHTStartCancelled("stopped while joining the swarm")
        dht = hivemind.DHT(
            initial_peers=list(config.initial_peers) or None,
            host_maddrs=list(config.host_maddrs),
            announce_maddrs=list(config.announce_maddrs) or None,
            client_mode=config.client_mode,
            record_validators=record_validators,
            startup_timeout=config.startup_timeout_seconds,
            identity_path=str(identity) if identity is not None else None,
            start=False,
        )
        remember_valid_records(dht, record_validators)
        try:
            _wait_until_ready(dht, config.startup_timeout_seconds, cancelled)
            return dht
        except DHTStartCancelled:
            _discard(dht, stop_now=True)
            raise
        except Exception as e:  # hivemind raises P2PDaemonError, RuntimeError, TimeoutError, ...
            if isinstance(e, TimeoutError) and not str(e):
                e = TimeoutError(f"not ready within --startup-timeout-seconds {config.startup_timeout_seconds:g}")
            last_error = e
            _discard(dht)
            offset = clock_offset_from(e)
            if offset is not None:  # no retry mends a clock
                raise DHTStartError(
                    f"this machine's clock is {abs(offset):.0f}s {'ahead of' if offset > 0 else 'behind'} the "
                    f"initial peer's, and hivemind refuses to join a swarm whose clocks differ by more than "
                    f"{MAX_DHT_TIME_DISCREPANCY_SECONDS:g}s: set this machine's clock right "
                    f"(e.g. enable NTP: timedatectl set-ntp true) and start again"
                ) from e
            if attempt < config.startup_attempts:
                logger.warning(
                    f"DHT start attempt {attempt}/{config.startup_attempts} failed ({one_line(e)}); "
                    f"retrying in {backoff:.0f}s"
                )
                sleep(backoff)
                backoff *= 2
    tried = ", ".join(config.initial_peers) if config.initial_peers else "no initial peers"
    raise DHTStartError(
        f"could not join the swarm after {config.startup_attempts} attempts "
        f"(initial peers tried: {tried}; listening on {', '.join(config.host_maddrs)}); "
        f"last error: {one_line(last_error)}; check that an initial peer is running and reachable, "
        f"or raise --startup-attempts / --startup-timeout-seconds"
    ) from last_error


_CLOCK_MISMATCH = re.compile(r"local time must be within .*local: (-?[\d.]+), peer: (-?[\d.]+)")


def clock_offset_from(error: BaseException) -> Optional[float]:
    """How far this machine's clock is ahead of an initial peer's (negative: behind), if hivemind's bootstrap
    ping refused to join for that reason; else None."""
    found = _CLOCK_MISMATCH.search(str(error))
    return float(found.group(1)) - float(found.group(2)) if found else None


def _wait_until_ready(dht: hivemind.DHT, timeout_seconds: float, cancelled: Callable[[], bool]) -> None:
    """hivemind's run_in_background(await_ready=True), in slices, so that a stop request is noticed."""
    dht.run_in_background(await_ready=False)
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            dht.wait_until_ready(timeout=max(0.0, min(READY_POLL_SECONDS, deadline - time.monotonic())))
            return
        except TimeoutError:
            if cancelled():
                raise DHTStartCancelled("stopped while joining the swarm") from None
            if time.monotonic() >= deadline:
                raise


def _discard(dht: hivemind.DHT, timeout_seconds: float = 5.0, stop_now: bool = False) -> None:
    """After a failed or cancelled attempt: make sure its DHT process and p2pd are gone."""
    try:
        children = psutil.Process(dht.pid).children(recursive=True) if dht.pid else []
    except psutil.Error:
        children = []
    if not stop_now:
        dht.join(timeout_seconds)  # a failed start ends the DHT process by itself
    if dht.is_alive():  # timed out or cancelled while still starting
        dht.terminate()
        dht.join(timeout_seconds)
    for child in children:  # p2pd, when hivemind did not stop it on the way out
        try:
            child.kill()
        except psutil.Error:
            pass


def visible_maddrs(dht: hivemind.DHT) -> List[str]:
    """Addresses another machine can pass to --initial-peers, loopback last."""
    maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
    return sorted(maddrs, key=lambda maddr: ("/ip4/127." in maddr or "/ip6/::1/" in maddr, maddr))


async def _silence_hivemind_logs(dht, node) -> None:
    """Runs inside the DHT process (see quiet_dht_logs)."""
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)
    # An averager process that exits with a request still in the DHT's pipe leaves it a pipe end it cannot fetch
    # (the request's reply channel): the DHT process dies of an EOFError, and multiprocessing prints its traceback
    # on the stderr it shares with the peer (CI: in the log of a peer that stopped as planned). Nothing it prints
    # from here on is news to anyone.
    sys.stderr = open(os.devnull, "w")


def quiet_dht_logs(dht: Optional[hivemind.DHT], timeout_seconds: float = 5.0) -> None:
    """Before leaving: the DHT process logs pipe errors while its siblings exit; they mean nothing to users."""
    if dht is None or not dht.is_alive():
        return
    try:
        dht.run_coroutine(_silence_hivemind_logs, return_future=True).result(timeout_seconds)
    except Exception as e:
        logger.debug(f"could not quiet the DHT process's logs: {e!r}")


async def _nothing(dht: hivemind.DHT, node) -> None:
    return None


def shutdown_dht(dht: Optional[hivemind.DHT], timeout_seconds: float = 10.0) -> None:
    """Stop the DHT process and its p2p daemon, with a bounded wait and no traceback for the user."""
    if dht is None or not dht.is_alive():
        return
    try:
        # Requests sent without waiting (hivemind's tracker withdraws its record that way) carry a pipe that
        # the DHT process fetches from this one: let it receive them all before either side goes away,
        # or it dies with an EOFError traceback. It handles requests in order, so one round trip is enough.
        dht.run_coroutine(_nothing, return_future=True).result(timeout=timeout_seconds)
    except Exception as e:
        logger.debug(f"DHT flush before shutdown raised {one_line(e)}")
    try:
        dht.shutdown()
        dht.join(timeout_seconds)
    except Exception as e:  # hivemind's shutdown can fail noisily once the peer is already half gone
        logger.debug(f"DHT shutdown raised {one_line(e)}")
    if dht.is_alive():
        logger.warning(f"DHT process did not exit within {timeout_seconds:.0f}s; terminating it")
        dht.terminate()
        dht.join(timeout_seconds)


def one_line(error: Optional[BaseException]) -> str:
    """An exception as one short line: 'TypeName: message'."""
    if error is None:
        return "unknown error"
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text}"[:400]
