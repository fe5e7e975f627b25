"""Swarm views at hundreds of peers: what `peer status`, the monitor and the training peers pay as the swarm grows.

A run of 1 or 2 real `peer start` processes (``--task bytelm-tiny``, the asyncio harness of peer/testing/) is joined
by N simulated peers that train nothing but publish the records a real peer publishes, each signed with its own
RSA key exactly as a real peer's are (so that every node's validators, dht.records.record_validators and hivemind's
schema validator, accept them; the tool checks that a reader sees all of them):

- its PeerInfo (dht/records.py) under ``SwarmKeys.peers``, every PUBLISH_PERIOD_SECONDS, living RECORD_TTL_SECONDS:
  a libp2p-style peer id, version, device, a plausible rate, the swarm's epoch, fractions, bottleneck, val_loss,
  ``state: agrees`` and a credit record naming a few peers it observed;
- hivemind's progress record (LocalTrainingProgress) under ``SwarmKeys.progress``, as often, living as long as a
  real peer's (averaging/strategies/factory.py): at the swarm's epoch, with **no samples and hivemind's idle rate**,
  the record a paused peer publishes (averaging/swarm/progress.py stand_idle). A plausible rate would make the
  real peers' trackers expect the target early (hivemind's ETA sums every record's rate) and so drive their epochs:
  the epoch-rate ratio is meant to measure the cost of reading N records, not a swarm that trains faster;
- its clock record (dht/clock.py) under ``SwarmKeys.clock``, every CLOCK_PERIOD_SECONDS, living two hours;
- its copy of the run manifest (dht/manifest.py), as every peer holds one, refreshed as real peers do.
State digests are not simulated: with peers that hold no state, copies of the real peers' digests would only
outvote them.

The simulated peers share a few publisher DHT nodes (``--publishers``, in this process, client mode: like
`peer status`, they store on the real peers' DHT nodes, which then hold and serve every record, as a replica of
the run's keys does in a real swarm). A publisher stores one key's records of all its simulated peers at once (one
request per replica), so its own cost is lower than N peers'; the nodes that store and serve the records validate
each signature as they would N peers'. Each publisher signs through a validator holding its peers' keys
(ManySigners): a node's RSASignatureValidator signs only records in its own key's subkey.

Measured for each N (``--sizes``; N = 0 is the baseline, run before each N and once at the end, so that each N is
compared with the baselines next to it):

1. `peer status --json`, run as a person runs it (a subprocess), wall time; it must list N + real peers;
2. the monitor's refresh (peer/cli/monitor.py: read_swarm, then the collector's and the page's update) on a
   client DHT joined as the monitor joins, and rendering /metrics and /swarm.json from that snapshot;
3. ClaimFilter.filter() (averaging/swarm/claims.py) on the progress record's N + real entries, as a training peer
   calls it; and the real peers' epochs per minute over a quiet stretch of the window (no status or monitor
   running), over the baselines' next to it;
4. memory (PSS, and RSS, from /proc/<pid>/smaps_rollup): each real peer's training process and its whole process
   tree, the publishers' DHT processes with their p2pd, the reader's, and the largest total of a status process tree;
5. failures: stores the nodes refused, reads that failed or came back short, status exit codes.

Usage (from the repository root)::

    python -m benchmarks.swarm_views            # N = 25, 50, 100, 200; 2 real peers (about 9 minutes)
    python -m benchmarks.swarm_views --quick    # N = 10, 25 (about 5 minutes)
    python -m benchmarks.swarm_views --smoke    # N = 5 and 1 real peer; for tests

JSON ``results``: the settings (``task``, ``real_peers``, ``publishers``, ``sizes``, ``schedule``,
``target_batch_size``, ``rate_seconds``, ``status_runs``, ``monitor_refreshes``, ``claim_calls``,
``key_generation_seconds``, ``record_periods_seconds``: each kind's refresh period and lifetime); ``windows``, one
row per window in the order run: ``n``, ``expected_peers`` (N + real), ``reader_saw`` (live records per key once
they settled), ``complete`` (every reader below saw ``expected_peers``), ``entries`` (per key at the window's end,
withdrawn ones included), ``record_bytes`` (per key: subkeys, values and signatures, about what one read carries),
``get_seconds`` (per key, one read); ``epochs_per_minute`` (median over the real peers, ``..._per_peer`` beside it);
``cpu_cores`` over that stretch (cores busy: ``real_training`` and ``real_tree`` per real peer, the tree being its
DHT, p2pd, averagers and data workers too; ``publishers``; ``reader``); ``memory_mib`` (``real_peers``: per peer
``training_pss``, ``training_rss``, ``tree_pss``; ``publishers``, ``reader``, ``status_tree_pss_max``);
``status_seconds`` (stats), ``status_peers`` and ``status_training_peers`` (what each status run listed),
``status_exit_codes``; ``monitor_refresh_seconds`` and ``monitor_render_seconds`` (stats), ``monitor_peers``;
``claim_filter_ms`` (stats), ``claims_believed``; ``publisher`` (records ``stored`` and ``failed`` during the window,
``errors``, ``longest_refresh_gap_seconds`` per kind: above a record's lifetime, the publisher let records lapse);
``errors``. ``by_size``: per N, its medians beside the baselines' next to it, ``epoch_rate_ratio`` (its rate over the
mean of the baselines before and after it), the largest real peer's ``training_pss_mib`` and ``real_tree_cpu_cores``,
the publishers' ``publishers_cpu_cores`` and ``publishers_pss_mib``, ``status_tree_pss_mib``, ``complete``;
``real_peer_exit_codes``; ``real_peer_epochs`` (the last epoch each reached).
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import psutil
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.optim.progress_tracker import LocalTrainingProgress, TrainingProgressSchema
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from averaging.config import AveragingConfig
from averaging.strategies.factory import progress_record_ttl_seconds
from averaging.swarm.claims import ClaimFilter
from averaging.swarm.progress import clock_skew_allowed
from benchmarks import common
from benchmarks.robustness import epochs_per_minute
from benchmarks.scaling import epochs, stop_all
from dht.clock import CLOCK_PERIOD_SECONDS
from dht.config import DHTConfig
from dht.keys import SwarmKeys
from dht.manifest import MANIFEST_TTL_SECONDS, REFRESH_PERIOD_SECONDS, agreed_manifest, read_manifests
from dht.node import one_line, shutdown_dht, start_dht
from dht.records import (
    CLOCK_RECORD_TTL_SECONDS,
    PUBLISH_PERIOD_SECONDS,
    RECORD_TTL_SECONDS,
    CreditRecord,
    PeerInfo,
    record_validators,
)
from monitoring import HealthCheck
from monitoring.phases import CATEGORIES
from monitoring.swarm_metrics import SwarmCollector
from monitoring.swarm_page import SwarmPage
from peer.cli.status import claim_filter, join_as_client, read_swarm
from peer.config import load_config
from peer.telemetry.events import latest_epoch, read_events
from peer.testing import Peer, PeerFailed, Swarm, session_processes, signal_session
from peer.version import __version__

NAME = "swarm_views"
RUN_SETTLE_SECONDS = 3.0  # after the reader sees a new N: the real peers' trackers fetch within a few seconds
SEE_TIMEOUT_SECONDS = 90.0
STORE_TIMEOUT_SECONDS = 30.0
STATUS_TIMEOUT_SECONDS = 60.0
TICK_SECONDS = 0.25
IDLE_RATE = 1e-20  # hivemind's PerformanceEMA eps: the rate a paused peer's progress record carries
DEVICES = ("cpu", "NVIDIA GeForce RTX 3090", "NVIDIA A100-SXM4-40GB", "NVIDIA GeForce RTX 4070 Laptop GPU")
KEY_KINDS = ("progress", "peers", "clock", "manifest")


# ---------------------------------------------------------------------------------------- simulated peers


@dataclass
class SimPeer:
    """One simulated peer: its own key (the owner of its records) and what its PeerInfo says."""

    key: RSAPrivateKey
    subkey: bytes
    peer_id: str
    peer_id_bytes: bytes
    device: str
    rate: float
    val_loss: float
    observed: Dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)


def make_sim_peers(count: int, seed: int = 0) -> List[SimPeer]:
    rng, sims = random.Random(seed), []
    for _ in range(count):
        key = RSAPrivateKey()
        # an Ed25519 libp2p id (12D3KooW...): the identity multihash of a protobuf-wrapped 32-byte public key
        peer_id = PeerID(b"\x00\x24\x08\x01\x12\x20" + rng.randbytes(32))
        sims.append(SimPeer(key, RSASignatureValidator(key).local_public_key, peer_id.to_base58(), peer_id.to_bytes(),
                            rng.choice(DEVICES), round(rng.uniform(5.0, 400.0), 2), round(rng.uniform(2.5, 4.0), 4)))
    for sim in sims:  # credit: what it saw a few others give (a real peer names those it averaged with)
        for other in rng.sample(sims, min(8, len(sims))):
            if other is not sim:
                sim.observed[other.peer_id] = float(rng.randrange(0, 50_000))
    return sims


class ManySigners(RecordValidatorBase):
    """Signs a record stored in the subkey of any of `keys` as that key's RSASignatureValidator would (a node's own
    RSASignatureValidator signs only its own key's records). It validates nothing: every node's
    RSASignatureValidator checks the signature by the public key in the subkey, this one's included."""

    def __init__(self, keys: Sequence[RSAPrivateKey]):
        self.signers = {RSASignatureValidator(key).local_public_key: RSASignatureValidator(key) for key in keys}
        self.owner = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)

    def validate(self, record) -> bool:
        return True

    def sign_value(self, record) -> bytes:
        found = self.owner.search(record.subkey)
        signer = self.signers.get(found.group(0)) if found else None
        return signer.sign_value(record) if signer is not None else record.value

    @property
    def priority(self) -> int:
        return 11  # signs after RSASignatureValidator (10), which leaves these records alone


SIMULATED: Dict[str, Any] = {}
"""The simulated peers of the publisher about to start, and the manifest they hold: set before its DHT process forks,
so that a request to that process names the peers (which, at what epoch) instead of carrying their records.
multiprocessing writes a message over 16 KiB in two writes, and hivemind's DHT process reads its pipe without
blocking (uvloop's add_reader): it can read the header alone, fail with EAGAIN, and die of the half message that
follows (seen here with 25 PeerInfo records in one request)."""


def record_value(kind: str, sim: SimPeer, epoch: int, manifest: dict, now: float):
    """What a real peer stores under this kind of key (the module's docstring says what differs)."""
    if kind == "peers":
        return PeerInfo(
            peer_id=sim.peer_id, version=__version__, device=sim.device, client_mode=False,
            samples_per_second=sim.rate, global_epoch=epoch, uptime_seconds=time.monotonic() - sim.started,
            time=time.time(), fractions=dict(zip(CATEGORIES, (0.08, 0.67, 0.2, 0.05))), bottleneck="compute",
            val_loss=sim.val_loss, state="agrees",
            credit=CreditRecord(samples=sim.rate * 600, device_seconds=400.0, sent_bytes=12 * 2**20,
                                observed=sim.observed),
        ).dict()
    if kind == "progress":
        return LocalTrainingProgress(peer_id=sim.peer_id_bytes, epoch=epoch, samples_accumulated=0,
                                     samples_per_second=IDLE_RATE, time=now, client_mode=False).dict()
    if kind == "clock":
        return {"time": now}
    return manifest


async def _publish(dht, node, kind: str, first: int, last: int, epoch: int, lifetime: float, withdraw: bool) -> int:
    """Runs in a publisher's DHT process: store (or withdraw) one kind of record of its simulated peers first..last-1
    at once, one request per replica. Not in its own storage: no reader asks a client-mode node, so only the
    replicas' answers count as stored."""
    sims, now = SIMULATED["sims"][first:last], get_dht_time()
    values = [None if withdraw else record_value(kind, sim, epoch, SIMULATED["manifest"], now) for sim in sims]
    stored = await node.store_many([getattr(SIMULATED["keys"], kind)] * len(sims), values, now + lifetime,
                                   subkeys=[sim.subkey for sim in sims], exclude_self=True)
    return sum(1 for ok in stored.values() if ok)


def swarm_epoch(events_paths: List[Path]) -> Callable[[], int]:
    """The real peers' newest epoch, from their events files (read here, not through the DHT: the simulated peers'
    own reads would load the machine, yet no real peer pays for them)."""
    offsets, newest, lock = {path: 0 for path in events_paths}, [0], threading.Lock()

    def read() -> int:
        with lock:
            for path in events_paths:
                events, offsets[path] = read_events(path, offsets[path])
                newest[0] = max(newest[0], latest_epoch(events))
            return newest[0]

    return read


class Publisher(threading.Thread):
    """Refreshes the records of one DHT node's simulated peers, each kind on the period real peers refresh it."""

    def __init__(self, dht, size: int, periods: Dict[str, tuple], epoch: Callable[[], int]):
        super().__init__(name=f"publisher-{dht.pid}", daemon=True)
        self.dht, self.size, self.periods, self.swarm_epoch = dht, size, periods, epoch
        self.active, self.stored, self.failed, self.errors = 0, 0, 0, []
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.due = {kind: 0.0 for kind in periods}
        self.refreshed: Dict[str, float] = {}  # by kind: when its last refresh ended
        self.longest_gap: Dict[str, float] = {}  # by kind: the longest time between two refreshes' ends

    @classmethod
    def start_for(cls, address: str, keys: SwarmKeys, sims: List[SimPeer], manifest: dict,
                  periods: Dict[str, tuple], epoch: Callable[[], int]) -> "Publisher":
        """A client-mode DHT node with every validator a real node installs, and one that signs as its peers."""
        SIMULATED.update(sims=sims, manifest=manifest, keys=keys)  # before the fork: its DHT process keeps this copy
        validators = [*record_validators(keys), SchemaValidator(TrainingProgressSchema, prefix=keys.namespace),
                      ManySigners([sim.key for sim in sims])]
        dht = start_dht(DHTConfig(initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True),
                        record_validators=validators)
        return cls(dht, len(sims), periods, epoch)

    def run(self) -> None:
        while not self.stopped.wait(TICK_SECONDS):
            with self.lock:
                for kind, (period, _) in self.periods.items():
                    if time.monotonic() >= self.due[kind]:
                        self.due[kind] = time.monotonic() + period
                        self._store(kind, 0, self.active)
                        self._refreshed(kind)

    def _refreshed(self, kind: str) -> None:
        """A gap longer than a record's lifetime means the publisher, not the DHT, let its records lapse."""
        now = time.monotonic()
        if kind in self.refreshed and self.active:
            self.longest_gap[kind] = max(self.longest_gap.get(kind, 0.0), now - self.refreshed[kind])
        self.refreshed[kind] = now

    def set_active(self, count: int) -> None:
        """Simulate its first `count` peers from now on: the others withdraw their records (None, as a real peer
        that leaves does), the newcomers publish at once."""
        with self.lock:
            was, self.active = self.active, min(count, self.size)
            for kind, (period, _) in self.periods.items():
                self._store(kind, self.active, was, withdraw=True)
                self._store(kind, 0, self.active)
                self.refreshed[kind], self.due[kind] = time.monotonic(), time.monotonic() + period
            self.longest_gap = {}

    def close(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join(STORE_TIMEOUT_SECONDS)

    def _store(self, kind: str, first: int, last: int, withdraw: bool = False) -> None:
        if last <= first:
            return
        if not self.dht.is_alive():  # its pipe would take requests until full, then block for good
            self.failed += last - first
            self.errors.append(f"{kind} x{last - first}: the publisher's DHT process is gone")
            return
        publish = functools.partial(_publish, kind=kind, first=first, last=last, epoch=max(0, self.swarm_epoch()),
                                    lifetime=self.periods[kind][1], withdraw=withdraw)
        try:
            ok = self.dht.run_coroutine(publish, return_future=True).result(timeout=STORE_TIMEOUT_SECONDS)
        except Exception as e:  # reported with the window: a store that fails at large N is a finding
            ok = 0
            self.errors.append(f"{kind} x{last - first}: {one_line(e)}")
        self.stored, self.failed = self.stored + ok, self.failed + last - first - ok


# ---------------------------------------------------------------------------------------- measuring


def family(pid: int, tree: bool = True) -> List[psutil.Process]:
    """A process and, with `tree`, its live descendants (DHT, p2pd, averagers, data workers)."""
    try:
        process = psutil.Process(pid)
        return [process, *(process.children(recursive=True) if tree else [])]
    except psutil.Error:
        return []


def tree_pss_mib(pid: int) -> float:
    return round(sum(common.process_memory_kib(each.pid)["Pss"] for each in family(pid)) / 1024, 1)


def cpu_seconds(pid: int, tree: bool) -> float:
    return sum(common.process_cpu_seconds(each.pid) or 0.0 for each in family(pid, tree))


def run_status(args: List[str], workdir: Path) -> dict:
    """`peer status --json` as a person runs it: wall time, what it listed, the most memory its processes held."""
    out_path = workdir / "status.out"
    with open(out_path, "w") as out:  # a file, not a pipe: 200 peers' JSON would fill a pipe while we sample
        started = time.monotonic()
        process = subprocess.Popen([sys.executable, "-m", "peer", "status", "--json", *args], stdout=out,
                                   stderr=subprocess.STDOUT, env=common.child_env(), start_new_session=True)
        peak = 0.0
        try:
            while process.poll() is None and time.monotonic() - started < STATUS_TIMEOUT_SECONDS + 30:
                pss = sum(common.process_memory_kib(each.pid)["Pss"] for each in session_processes(process.pid)) / 1024
                peak = max(peak, pss)
                time.sleep(0.2)
            seconds = time.monotonic() - started
        finally:
            if process.poll() is None:  # ran over its own --timeout-seconds, or we are stopping: it and its DHT
                signal_session(process.pid, signal.SIGKILL)
            code = process.wait(10)
    text = out_path.read_text(errors="replace")
    report = next((json.loads(line) for line in text.splitlines() if line.startswith("{")), None)
    return {"seconds": seconds, "exit_code": code, "tree_pss_mib": round(peak, 1), "report": report,
            "tail": None if report else text[-500:]}


def read_keys(dht, keys: SwarmKeys, signature_bytes: int) -> Dict[str, dict]:
    """Per key: the time of one read, its entries, the live ones, and the bytes a read carries (subkeys, values,
    signatures)."""
    found_keys = {}
    for kind in KEY_KINDS:
        started = time.perf_counter()
        found = dht.get(getattr(keys, kind), latest=True, return_future=True).result(timeout=SEE_TIMEOUT_SECONDS)
        seconds, now = time.perf_counter() - started, get_dht_time()
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        found_keys[kind] = {
            "get_seconds": round(seconds, 4),
            "entries": len(entries),
            "live": sum(1 for entry in entries.values() if entry.value is not None and entry.expiration_time >= now),
            "bytes": sum(len(owner) + len(MSGPackSerializer.dumps(entry.value)) + signature_bytes
                         for owner, entry in entries.items()),
        }
    return found_keys


def wait_until_seen(dht, keys: SwarmKeys, expected: int, signature_bytes: int) -> dict:
    """Read the keys until every kind has exactly `expected` live records (or SEE_TIMEOUT_SECONDS pass)."""
    deadline, found = time.monotonic() + SEE_TIMEOUT_SECONDS, {}
    while time.monotonic() < deadline:
        try:
            found = read_keys(dht, keys, signature_bytes)
        except Exception as e:  # a read that fails at large N is a finding: keep trying until the deadline
            found = {"error": repr(e)}
        if all(found.get(kind, {}).get("live") == expected for kind in KEY_KINDS):
            break
        time.sleep(1.0)
    return found


def time_monitor(dht, config, claims: ClaimFilter, refreshes: int) -> tuple:
    """The monitor's refresh (peer/cli/monitor.py run_monitor's loop body) and its rendering of the snapshot."""
    collector, health = SwarmCollector(clock=time.monotonic), HealthCheck(config.monitoring.health_window_seconds)
    page = SwarmPage(health, refresh_seconds=5.0)
    refresh, render, snapshot = [], [], None
    for _ in range(refreshes):
        started = time.perf_counter()
        snapshot = read_swarm(dht, config, STATUS_TIMEOUT_SECONDS, claims)
        collector.update(snapshot)
        page.update(snapshot)
        health.beat()
        refresh.append(time.perf_counter() - started)
        started = time.perf_counter()
        list(collector.collect())
        page.routes()["/swarm.json"]()
        render.append(time.perf_counter() - started)
    return refresh, render, snapshot


def time_claims(dht, keys: SwarmKeys, target_batch_size: int, ttl_seconds: float, epoch: int, calls: int) -> tuple:
    """ClaimFilter.filter() on the progress record's entries, built as a training peer builds it."""
    found = dht.get(keys.progress, latest=True, return_future=True).result(timeout=SEE_TIMEOUT_SECONDS)
    metadata = found.value if found is not None and isinstance(found.value, dict) else {}
    skew = clock_skew_allowed(1.0)
    claims = ClaimFilter(b"a peer of its own", target_batch_size, max_ttl_seconds=ttl_seconds + skew,
                         max_clock_skew_seconds=skew)
    times, kept = [], {}
    for _ in range(calls):
        started = time.perf_counter()
        kept = claims.filter(metadata, get_dht_time(), local_epoch=epoch)
        times.append((time.perf_counter() - started) * 1000)
    return times, sum(1 for entry in kept.values() if entry.value is not None)


# ---------------------------------------------------------------------------------------- the run


@dataclass
class Bench:
    """Everything a window needs: the settings, the swarm's processes and the reader."""

    settings: dict
    real: List[Peer]
    publishers: List[Publisher]
    reader: Any
    config: Any
    claims: Any  # the monitor's ClaimFilter, kept across its refreshes as the monitor keeps it
    keys: Any
    status_args: List[str]
    workdir: Path
    signature_bytes: int
    log: Callable[[str], None]


def measure_window(bench: Bench, n: int) -> dict:
    """Simulate N peers, wait until a reader sees them all, then measure; one row of `windows`."""
    expected, count = n + len(bench.real), len(bench.publishers)
    for index, publisher in enumerate(bench.publishers):  # deal the N simulated peers round-robin
        publisher.set_active(n // count + (index < n % count))
    row: Dict[str, Any] = {"n": n, "expected_peers": expected, "errors": []}
    seen = wait_until_seen(bench.reader, bench.keys, expected, bench.signature_bytes)
    row["reader_saw"] = {kind: seen.get(kind, {}).get("live") for kind in KEY_KINDS}
    if "error" in seen:
        row["errors"].append(f"reader: {seen['error']}")
    stored_before = [(publisher.stored, publisher.failed) for publisher in bench.publishers]
    time.sleep(RUN_SETTLE_SECONDS)
    quiet_stretch(bench, row)
    status_runs(bench, row)
    in_process_readers(bench, row)
    row["publisher"] = {
        "stored": sum(p.stored - before[0] for p, before in zip(bench.publishers, stored_before)),
        "failed": sum(p.failed - before[1] for p, before in zip(bench.publishers, stored_before)),
        "errors": [error for p in bench.publishers for error in p.errors][-5:],
        # by kind, the longest any publisher took between two refreshes: over a record's lifetime, its records lapsed
        "longest_refresh_gap_seconds": {kind: round(max(p.longest_gap.get(kind, 0.0) for p in bench.publishers), 1)
                                        for kind in KEY_KINDS},
    }
    for publisher in bench.publishers:
        publisher.errors.clear()
    # every reader saw every peer: the reader's DHT reads, each status run, the monitor, the claim filter
    seen_by = [*row["reader_saw"].values(), *row["status_peers"], *row["status_training_peers"],
               row.get("monitor_peers"), row.get("claims_believed")]
    row["complete"] = all(count == expected for count in seen_by)
    bench.log(summary_of(row))
    return row


def quiet_stretch(bench: Bench, row: dict) -> None:
    """The real peers' epoch rate while only the publishers (and the swarm) run, where the CPU went meanwhile, and
    then everyone's memory."""
    groups = {"real_training": [(peer.pid, False) for peer in bench.real],
              "real_tree": [(peer.pid, True) for peer in bench.real],
              "publishers": [(publisher.dht.pid, True) for publisher in bench.publishers],
              "reader": [(bench.reader.pid, True)]}
    cpu_before = {name: [cpu_seconds(*each) for each in members] for name, members in groups.items()}
    since = time.time()
    time.sleep(bench.settings["rate_seconds"])
    until = time.time()
    per_peer = [epochs_per_minute(peer, since, until) for peer in bench.real]
    row["epochs_per_minute"] = common.rounded(common.stats(per_peer)["median"], 2)
    row["epochs_per_minute_per_peer"] = [common.rounded(rate, 2) for rate in per_peer]
    row["cpu_cores"] = {name: [round((cpu_seconds(*each) - before) / (until - since), 3)
                               for each, before in zip(members, cpu_before[name])]
                        for name, members in groups.items()}
    training = {peer.pid: common.process_memory_kib(peer.pid) for peer in bench.real}
    row["memory_mib"] = {
        "real_peers": [{"training_pss": round(training[peer.pid]["Pss"] / 1024, 1),
                        "training_rss": round(training[peer.pid]["Rss"] / 1024, 1),
                        "tree_pss": tree_pss_mib(peer.pid)} for peer in bench.real],
        "publishers": [tree_pss_mib(publisher.dht.pid) for publisher in bench.publishers],
        "reader": tree_pss_mib(bench.reader.pid),
    }


def status_runs(bench: Bench, row: dict) -> None:
    statuses = [run_status(bench.status_args, bench.workdir) for _ in range(bench.settings["status_runs"])]
    row["status_seconds"] = common.stats([s["seconds"] for s in statuses], 3)
    row["status_exit_codes"] = [s["exit_code"] for s in statuses]
    row["status_peers"] = [len(s["report"]["peers"]) if s["report"] else None for s in statuses]
    row["status_training_peers"] = [s["report"]["swarm"]["training_peers"] if s["report"] else None for s in statuses]
    row["memory_mib"]["status_tree_pss_max"] = max(s["tree_pss_mib"] for s in statuses)
    row["errors"] += [f"status exit {s['exit_code']}: {s['tail']}" for s in statuses if s["report"] is None]


def in_process_readers(bench: Bench, row: dict) -> None:
    """The monitor's refreshes, the claim filter and the keys' sizes, on the reader's client DHT."""
    settings = bench.settings
    try:
        refresh, render, snapshot = time_monitor(bench.reader, bench.config, bench.claims,
                                                 settings["monitor_refreshes"])
        row["monitor_refresh_seconds"] = common.stats(refresh, 4)
        row["monitor_render_seconds"] = common.stats(render, 4)
        row["monitor_peers"] = len(snapshot["peers"])
        epoch = max(peer.epoch for peer in bench.real)
        claim_ms, row["claims_believed"] = time_claims(bench.reader, bench.keys, settings["target_batch_size"],
                                                       settings["progress_ttl_seconds"], epoch,
                                                       settings["claim_calls"])
        row["claim_filter_ms"] = common.stats(claim_ms, 4)
        keys_now = read_keys(bench.reader, bench.keys, bench.signature_bytes)
        row["entries"] = {kind: found["entries"] for kind, found in keys_now.items()}
        row["record_bytes"] = {kind: found["bytes"] for kind, found in keys_now.items()}
        row["get_seconds"] = {kind: found["get_seconds"] for kind, found in keys_now.items()}
    except Exception as e:  # a read that fails or times out at large N is a finding, reported with the window
        row["errors"].append(f"in-process readers: {e!r}")


def summary_of(row: dict) -> str:
    def median(name: str, scale: float = 1.0, digits: int = 3) -> str:
        value = (row.get(name) or {}).get("median")
        return "n/a" if value is None else f"{value * scale:.{digits}f}"

    memory = row["memory_mib"]
    training = [peer["training_pss"] for peer in memory["real_peers"]]
    return (f"N={row['n']}: status {median('status_seconds')} s (listed {row['status_peers']} of "
            f"{row['expected_peers']}), monitor refresh {median('monitor_refresh_seconds')} s, claim filter "
            f"{median('claim_filter_ms', digits=2)} ms, {row['epochs_per_minute']} epochs/min, PSS training "
            f"{training} MiB, publishers {memory['publishers']} MiB, status {memory['status_tree_pss_max']} MiB"
            + ("" if row["complete"] else f"; INCOMPLETE: reader saw {row['reader_saw']}, monitor "
                                          f"{row.get('monitor_peers')}, claim filter {row['claims_believed']}")
            + (f"; errors: {row['errors']}" if row["errors"] else ""))


def by_size(windows: List[dict]) -> Dict[str, dict]:
    """Per N: its medians beside those of the baselines next to it, and its epoch rate over theirs."""
    def median(row: dict, name: str) -> Optional[float]:
        return (row.get(name) or {}).get("median")

    table = {}
    for index, row in enumerate(windows):
        around = [windows[i] for i in (index - 1, index + 1) if 0 <= i < len(windows) and windows[i]["n"] == 0]
        if row["n"] == 0 or not around:
            continue
        base_rates = [base["epochs_per_minute"] for base in around if base["epochs_per_minute"]]
        base_rate = statistics.fmean(base_rates) if base_rates else None
        table[str(row["n"])] = {
            "status_seconds": median(row, "status_seconds"),
            "status_seconds_baseline": common.stats((median(base, "status_seconds") for base in around), 3)["median"],
            "monitor_refresh_seconds": median(row, "monitor_refresh_seconds"),
            "monitor_refresh_seconds_baseline": common.stats((median(base, "monitor_refresh_seconds")
                                                              for base in around), 4)["median"],
            "claim_filter_ms": median(row, "claim_filter_ms"),
            "epochs_per_minute": row["epochs_per_minute"],
            "epochs_per_minute_baseline": common.rounded(base_rate, 2),
            "epoch_rate_ratio": common.rounded(row["epochs_per_minute"] / base_rate, 3)
            if row["epochs_per_minute"] and base_rate else None,
            "training_pss_mib": max(peer["training_pss"] for peer in row["memory_mib"]["real_peers"]),
            "real_tree_cpu_cores": max(row["cpu_cores"]["real_tree"]),
            "publishers_cpu_cores": round(sum(row["cpu_cores"]["publishers"]), 3),
            "publishers_pss_mib": round(sum(row["memory_mib"]["publishers"]), 1),
            "status_tree_pss_mib": row["memory_mib"]["status_tree_pss_max"],
            "complete": row["complete"],
        }
    return table


async def start_real_peers(swarm: Swarm, count: int, timeout: float) -> List[Peer]:
    first = await swarm.add(timeout=timeout)
    others = [await swarm.add(ready=False) for _ in range(1, count)]
    await asyncio.gather(*(peer.ready(timeout) for peer in others))
    return [first, *others]


async def run_swarm(run: common.Run, settings: dict, sims: List[SimPeer], workdir: Path) -> tuple:
    """Start the real peers, the reader and the publishers; run every window; tear it all down on every path."""
    run_id, timeout = f"bench-views-{os.getpid()}", settings["start_timeout_seconds"]
    keys, windows, publishers, reader = SwarmKeys.for_run(run_id), [], [], None
    base = ["--task", settings["task"], "--run-id", run_id, "--target-batch-size", str(settings["target_batch_size"]),
            "--matchmaking-seconds", "1", "--averaging-timeout-seconds", "10", "--data-workers", "1",
            "--val-batches", "4", "--metrics-port", "off", "--checkpoint-every-epochs", "100000",
            "--min-peers", str(settings["real_peers"]), "--min-peers-timeout-seconds", "120"]
    async with Swarm(workdir, *base, env={"OMP_NUM_THREADS": "1"}) as swarm:
        try:
            real = await start_real_peers(swarm, settings["real_peers"], timeout)
            address, owner = real[0].address, real[0].run_owner
            owner_flag = {"run_owner": owner} if owner else {}
            config = load_config(flags={"run_id": run_id, "initial_peers": [address], "matchmaking_seconds": 1.0,
                                        "target_batch_size": settings["target_batch_size"],
                                        "host_maddrs": ["/ip4/127.0.0.1/tcp/0"], **owner_flag})
            reader = join_as_client(config, timeout)  # as the monitor joins
            manifest = agreed_manifest(read_manifests(reader, keys.manifest, 30.0, owner=owner))
            if manifest is None:
                raise PeerFailed("no run manifest readable: the simulated peers would have none to hold")
            count, epoch = settings["publishers"], swarm_epoch([peer.events_path for peer in real])
            for index in range(count):  # every DHT first: a fork while a publisher thread runs could copy a held lock
                publishers.append(Publisher.start_for(address, keys, sims[index::count], manifest.dict(),
                                                      settings["periods"], epoch))
            for publisher in publishers:
                publisher.start()
            status_args = ["--initial-peers", address, "--run-id", run_id, "--target-batch-size",
                           str(settings["target_batch_size"]), "--timeout-seconds", str(STATUS_TIMEOUT_SECONDS),
                           *(["--run-owner", owner] if owner else [])]
            bench = Bench(settings, real, publishers, reader, config, claim_filter(config), keys, status_args,
                          workdir, signature_bytes(sims[0].key), run.log)
            for n in settings["schedule"]:
                windows.append(measure_window(bench, n))
        finally:
            for publisher in publishers:
                publisher.close()
                try:  # say goodbye, as real peers do: the real peers then wait for none of them as they leave
                    publisher.set_active(0)
                finally:
                    shutdown_dht(publisher.dht)
            shutdown_dht(reader)
            exit_codes = await stop_all(swarm.training_peers)
            last_epochs = [epochs(peer)[-1].epoch if epochs(peer) else None for peer in swarm.training_peers]
    return windows, exit_codes, last_epochs


def signature_bytes(key: RSAPrivateKey) -> int:
    """What a record's signature adds to its value (hivemind strips it before a reader sees the value)."""
    return len(RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", key.sign(b"any")))


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--sizes", default=None, help="comma-separated numbers of simulated peers (default 25,50,100,200; "
                                                 "quick 10,25; smoke 5)")
    p.add_argument("--real-peers", type=int, default=None, help="real `peer start` processes (default 2; smoke 1)")
    p.add_argument("--publishers", type=int, default=None, help="DHT nodes the simulated peers share (default 2; "
                                                                "quick and smoke 1)")
    p.add_argument("--rate-seconds", type=float, default=None, help="quiet seconds per window for the epoch rate")
    args = p.parse_args(argv)
    mode = args.mode
    sizes = [int(x) for x in (args.sizes or common.by_mode(mode, smoke="5", quick="10,25", full="25,50,100,200"))
             .split(",")]
    real_peers = args.real_peers or common.by_mode(mode, smoke=1, quick=2, full=2)
    if real_peers < 1 or min(sizes) < 1:
        print("error: --real-peers and every --sizes value must be >= 1", file=sys.stderr)
        return 2
    progress_ttl = progress_record_ttl_seconds(AveragingConfig(matchmaking_seconds=1.0))
    settings = {
        "task": "bytelm-tiny",
        "real_peers": real_peers,
        "publishers": args.publishers or common.by_mode(mode, smoke=1, quick=1, full=2),
        "sizes": sizes,
        # a baseline before each N and after the last, so that each N has baselines next to it
        "schedule": [n for size in sizes for n in (0, size)] + ([0] if mode != "smoke" else []),
        "target_batch_size": 48,
        "rate_seconds": args.rate_seconds or common.by_mode(mode, smoke=3.0, quick=20.0, full=40.0),
        "status_runs": common.by_mode(mode, smoke=1, quick=2, full=3),
        "monitor_refreshes": common.by_mode(mode, smoke=2, quick=4, full=5),
        "claim_calls": common.by_mode(mode, smoke=5, quick=20, full=20),
        "start_timeout_seconds": 120.0,
        "progress_ttl_seconds": progress_ttl,
        "periods": {"progress": (PUBLISH_PERIOD_SECONDS, progress_ttl),
                    "peers": (PUBLISH_PERIOD_SECONDS, RECORD_TTL_SECONDS),
                    "clock": (CLOCK_PERIOD_SECONDS, CLOCK_RECORD_TTL_SECONDS),
                    "manifest": (REFRESH_PERIOD_SECONDS, MANIFEST_TTL_SECONDS)},
    }
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run = common.Run(NAME, mode, args.output)
    started = time.monotonic()
    sims = make_sim_peers(max(sizes))
    settings["key_generation_seconds"] = round(time.monotonic() - started, 1)
    with tempfile.TemporaryDirectory(prefix="swarmtrain-views-") as tmp:
        windows, exit_codes, last_epochs = asyncio.run(run_swarm(run, settings, sims, Path(tmp)))
    incomplete = [row["n"] for row in windows if not row["complete"]]
    if incomplete:
        run.note(f"a reader did not see every simulated peer's records at N = {incomplete} (see reader_saw)")
    run.note("the publishers run on this machine: their CPU (cpu_cores.publishers) slows the real peers too, which "
             "N machines of their own would not")
    run.note("the simulated progress records carry no samples and hivemind's idle rate (a paused peer's record), "
             "so that they do not drive the real peers' epochs")
    if any(row.get("entries", {}).get("clock", 0) > (row["reader_saw"]["clock"] or 0) for row in windows):
        run.note("withdrawn records stay in the DHT as None until they expire: clock records for two hours, manifest "
                 "copies for ten minutes, so baselines after an N still carry those entries (see entries)")
    table = by_size(windows)
    results = {**{k: v for k, v in settings.items() if k != "periods"}, "record_periods_seconds": settings["periods"],
               "windows": windows, "by_size": table, "real_peer_exit_codes": exit_codes,
               "real_peer_epochs": last_epochs}
    f = common.fmt_ratio
    line = f"{NAME} ({real_peers} real peers + N simulated): " + "; ".join(
        f"N={n}: status {f(v['status_seconds'])} s (N=0: {f(v['status_seconds_baseline'])}), monitor refresh "
        f"{f(v['monitor_refresh_seconds'])} s, claim filter {f(v['claim_filter_ms'])} ms, epoch rate ratio "
        f"{f(v['epoch_rate_ratio'])}" for n, v in table.items())
    run.finish(results, line)
    return 1 if incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
