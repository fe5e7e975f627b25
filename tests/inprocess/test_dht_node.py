"""start_dht with real hivemind nodes on 127.0.0.1: stable identity, initial peers, bounded retries."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import hivemind
import psutil
import pytest
from hivemind.utils import get_dht_time

from dht.config import DHTConfig
from dht.identity import IdentityInUse, ensure_identity
from dht.keys import SwarmKeys
from dht.node import DHTStartError, clock_offset_from, quiet_dht_logs, shutdown_dht, start_dht, visible_maddrs
from dht.records import read_by_owner, record_validators, store_own
from dht.verdicts import RememberingValidator
from peer.config import load_config
from peer.testing import session_processes
from tests.peers import REPO_ROOT, wait_until

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST = dict(host_maddrs=LOCAL, startup_timeout_seconds=20.0)


@pytest.fixture
def dhts():
    """Start DHT nodes that are shut down at teardown, on every path."""
    started = []

    def _start(config: DHTConfig, **kwargs):
        dht = start_dht(config, record_validators=record_validators(SwarmKeys.for_run("test")), **kwargs)
        started.append(dht)
        return dht

    try:
        yield _start
    finally:
        for dht in reversed(started):
            shutdown_dht(dht)


@pytest.mark.timeout(90)
def test_identity_keeps_the_peer_id_across_restarts(tmp_path: Path, dhts):
    key = tmp_path / "identity.key"
    first = dhts(DHTConfig(identity=key, **FAST))
    peer_id = first.peer_id
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    content = key.read_bytes()
    shutdown_dht(first)

    again = dhts(DHTConfig(identity=key, **FAST))
    assert again.peer_id == peer_id
    assert key.read_bytes() == content


def test_corrupt_identity_fails_before_starting_and_is_left_untouched(tmp_path: Path):
    key = tmp_path / "identity.key"
    key.write_bytes(b"\x08\x00\x12\x03abc")  # a protobuf header with a garbage RSA key
    key.chmod(0o600)
    before = key.stat()
    with pytest.raises(DHTStartError) as error:
        # bypasses config validation, as a key damaged after load would
        start_dht(DHTConfig.model_construct(**{**DHTConfig().model_dump(), "identity": key}))
    message = str(error.value)
    assert "\n" not in message
    assert f"identity file {key} is not a valid private key" in message
    assert key.read_bytes() == b"\x08\x00\x12\x03abc"
    assert key.stat().st_mtime_ns == before.st_mtime_ns and key.stat().st_mode == before.st_mode


@pytest.mark.timeout(120)
def test_initial_peers_from_file_and_from_env(tmp_path: Path, dhts):
    first = dhts(DHTConfig(**FAST))
    peers_file = tmp_path / "peers.txt"
    peers_file.write_text("# the first node\n" + "\n".join(visible_maddrs(first)) + "\n")
    assert first.store("greeting", "hello", expiration_time=get_dht_time() + 60)

    common = {"host_maddrs": LOCAL[0], "startup_timeout_seconds": "20"}
    from_file = load_config(flags={**common, "initial_peers_file": str(peers_file)}).dht
    from_env = load_config(environ={"PEER_INITIAL_PEERS": ",".join(visible_maddrs(first))}, flags=common).dht
    assert from_file.initial_peers == from_env.initial_peers == visible_maddrs(first)

    for config in (from_file, from_env):
        joined = dhts(config)
        found = joined.get("greeting", latest=True, return_future=True).result(timeout=20)
        assert found is not None and found.value == "hello"


@pytest.mark.timeout(90)
def test_unreachable_initial_peer_is_retried_then_one_line_error(tmp_path: Path):
    # a well-formed address of a peer that does not exist: a closed port and someone's peer id
    address = "/ip4/127.0.0.1/tcp/1/p2p/QmZurcthsZnDEsqwnnY67QJW6mAXMS3VayxHZMFQ6QHNKX"
    config = DHTConfig(initial_peers=[address], host_maddrs=LOCAL, startup_attempts=3, startup_timeout_seconds=10)
    slept = []
    with pytest.raises(DHTStartError) as error:
        start_dht(config, sleep=slept.append, first_backoff_seconds=0.5)
    assert slept == [0.5, 1.0]  # exponential backoff between the three attempts
    message = str(error.value)
    assert "\n" not in message
    assert "after 3 attempts" in message and address in message and "last error: " in message
    assert error.value.__cause__ is not None
    # each failed attempt's p2pd is stopped; on a loaded machine it may take a moment to be gone (told apart from
    # the p2pds of tests that other workers run meanwhile by the address it was told to bootstrap from)
    wait_until(lambda: not session_p2pds(bootstrapping_from=address), 15,
               message="no p2pd of a failed attempt to remain")


@pytest.mark.timeout(90)
def test_a_clock_off_at_start_is_named_at_once_with_the_fix(dhts, monkeypatch):
    first = dhts(DHTConfig(**FAST))
    # the joining node's clock an hour ahead: its DHT process, forked next, inherits the patched clock
    monkeypatch.setattr(hivemind.dht.protocol, "get_dht_time", lambda: get_dht_time() + 3600)
    slept = []
    config = DHTConfig(initial_peers=[str(a) for a in visible_maddrs(first)], startup_attempts=3, **FAST)
    with pytest.raises(DHTStartError) as error:
        start_dht(config, sleep=slept.append)
    assert slept == []  # no retry mends a clock
    message = str(error.value)
    assert re.fullmatch(r"this machine's clock is 3600s ahead of the initial peer's, .* timedatectl set-ntp true\) "
                        r"and start again", message), message


def test_a_clock_offset_is_read_only_from_hivemind_s_clock_refusal():
    refusal = ValueError("local time must be within 3 seconds  of others(local: 1700003600.5, peer: 1700000000.5)")
    assert clock_offset_from(refusal) == 3600.0
    assert clock_offset_from(TimeoutError("not ready within --startup-timeout-seconds 20")) is None


@pytest.mark.timeout(60)
def test_an_identity_another_running_peer_holds_is_refused_at_once(tmp_path: Path):
    key = tmp_path / "identity.key"
    ensure_identity(key)
    holder = subprocess.Popen(  # another peer on this machine, started with the same --identity
        [sys.executable, "-c", "import sys, time\nfrom dht.identity import lock_identity\n"
                               "lock_identity(sys.argv[1]); print('held', flush=True); time.sleep(60)", str(key)],
        stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(IdentityInUse, match=r"identity file .* is in use by another running peer"):
            start_dht(DHTConfig(identity=key, startup_attempts=3, **FAST))
    finally:
        holder.kill()
        holder.wait(10)


def session_p2pds(bootstrapping_from: str) -> list:
    """p2pd daemons in this test's session (an orphan keeps its session when it is reparented) told to bootstrap
    from an address: the other workers' tests start p2pds in the same session."""
    found = []
    for process in session_processes(os.getsid(0)):
        try:
            command = " ".join(process.cmdline())
        except psutil.Error:  # it exited meanwhile
            continue
        if "p2pd" in command and bootstrapping_from in command:
            found.append(process.pid)
    return found


async def _say_on_stderr(dht, node) -> None:
    """Runs inside the DHT process."""
    print("the DHT process speaks", file=sys.stderr, flush=True)


@pytest.mark.timeout(60)
def test_a_quieted_dht_process_prints_nothing_on_the_stderr_it_shares_with_the_peer(dhts, capfd):
    # what it would print: the traceback of an EOFError, when an averager process exits with a request in its pipe
    dht = dhts(DHTConfig(**FAST))
    dht.run_coroutine(_say_on_stderr)
    assert "the DHT process speaks" in capfd.readouterr().err
    quiet_dht_logs(dht)
    dht.run_coroutine(_say_on_stderr)
    assert "the DHT process speaks" not in capfd.readouterr().err


@pytest.mark.timeout(90)
def test_a_started_dht_remembers_valid_records_and_still_stores_and_reads_signed_ones(dhts):
    first = dhts(DHTConfig(**FAST))
    second = dhts(DHTConfig(initial_peers=visible_maddrs(first), **FAST))
    assert isinstance(first._record_validator, RememberingValidator)
    key = SwarmKeys.for_run("test").digests
    value = {"peer_id": "QmWriter", "digests": {"3": "ab" * 32}, "serves": True}
    assert store_own(second, key, value, ttl_seconds=30)
    for _ in range(3):  # read again and again: every copy valid, whether checked or remembered
        assert list(read_by_owner(first, key).values()) == [value]
