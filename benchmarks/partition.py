"""Time from heal to one swarm after a network partition (issue 30).

Four real `peer start` processes (bytelm-tiny: four peers share the machine's cores), each in its own network
namespace on one bridge (benchmarks/netns.py), start together (--min-peers 4) and train. Then the link between
peers {0, 1} and peers {2, 3} is cut for ``--cut-seconds`` (``Bridge.cut``: packets across it are lost, as when
a router between two sites fails), and restored. The peers' events files say the rest:

- ``epochs_during_cut``: per half, the epochs its peers ended while cut off (both halves must keep training), and
  ``longest_stall_during_cut_seconds``, the longest time in the cut during which no peer of the half ended one;
- ``split_reported_after_seconds``: per peer, from the cut to its first `swarm_split` event (dht/reconnect.py),
  ``split_unreachable``, the peers its `swarm_split` events named, and ``split_logged``, whether its log says so;
- ``rejoined_after_seconds``: per peer, from the heal to its `swarm_rejoined` event (its DHT reached the other
  half again);
- ``one_swarm_after_seconds``: from the heal until every peer has ended an epoch counting all four peers: the
  number this benchmark is for;
- ``last_resync_after_seconds``: from the heal to the last state download, refused download or disagreeing
  digest (`state_downloaded`, `download_rejected`, `state_checked` with agrees false) of any peer before the run
  was asked to end (None: there was none), and ``quiet_seconds_before_end``, how long none came after it: the
  behind half adopting the other's state, and how settled the swarm was after;
- then every peer ends at one epoch (the harness's end_soon), and ``max_parameter_difference`` compares their
  final checkpoints with peer 0's (``parameter_differences``, one per other peer): 0 means one swarm, one state;
  ``excluded``: the peers each one excluded (an honest peer excluded by another keeps the halves apart).

Needs root (network namespaces); without it the run is skipped, saying why. Usage (from the repository root)::

    python -m benchmarks.partition            # 3 runs, 40 s cuts
    python -m benchmarks.partition --quick    # 1 run, 40 s cut (about 3 minutes)
    python -m benchmarks.partition --smoke    # 1 run, 10 s cut, shorter than split detection (about 12 s); checks
                                              # that the script works

JSON ``results``: ``task``, ``peers``, ``halves``, ``cut_seconds``, ``runs`` (the fields above per run, with
``peer_ids``, ``exit_codes``, ``final_epochs`` and ``error``), ``one_swarm_after_seconds`` and
``rejoined_after_seconds`` (median, min, max over runs), and ``skipped``.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common, netns  # noqa: E402 (after the path fix above)

NAME = "partition"
PEERS = 4
HALVES = ([0, 1], [2, 3])
TASK_ARGS = ("--task", "bytelm-tiny", "--target-batch-size", "64", "--min-peers", str(PEERS))
RESYNC_EVENTS = ("state_downloaded", "download_rejected")


def _after(events, kind: str, since: float, where=lambda event: True):
    return next((event for event in events if event.event == kind and event.time >= since and where(event)), None)


def _seconds(event, since: float) -> Optional[float]:
    return None if event is None else round(event.time - since, 2)


def measure(events: Sequence[list], cut_at: float, healed_at: float, ended_at: float,
            halves: Sequence[Sequence[int]] = HALVES) -> dict:
    """The run's numbers, from each peer's events (in peer order) and the wall times of the cut, the heal and the
    request to end."""
    row: dict = {"epochs_during_cut": [], "longest_stall_during_cut_seconds": []}
    for half in halves:
        ended = sorted((event.time, event.epoch) for index in half for event in events[index]
                       if event.event == "epoch" and cut_at < event.time <= healed_at)
        row["epochs_during_cut"].append(len({epoch for _, epoch in ended}))
        moments = [cut_at, *(moment for moment, _ in ended), healed_at]
        row["longest_stall_during_cut_seconds"].append(round(max(b - a for a, b in zip(moments, moments[1:])), 2))
    row["split_reported_after_seconds"] = [_seconds(_after(peer, "swarm_split", cut_at), cut_at) for peer in events]
    # a peer may say it twice, as the second peer of the other half falls silent
    row["split_unreachable"] = [sorted({unreachable for event in peer if event.event == "swarm_split"
                                        and event.time >= cut_at for unreachable in event.unreachable}) or None
                                for peer in events]
    row["rejoined_after_seconds"] = [_seconds(_after(peer, "swarm_rejoined", healed_at), healed_at)
                                     for peer in events]
    whole = [_after(peer, "epoch", healed_at, lambda event: event.peers >= len(events)) for peer in events]
    row["one_swarm_after_seconds"] = None if None in whole else round(max(e.time for e in whole) - healed_at, 2)
    resyncs = [event.time for peer in events for event in peer if healed_at <= event.time < ended_at and (
        event.event in RESYNC_EVENTS or (event.event == "state_checked" and not event.agrees))]
    last_resync = max(resyncs, default=None)
    row["last_resync_after_seconds"] = None if last_resync is None else round(last_resync - healed_at, 2)
    row["quiet_seconds_before_end"] = round(ended_at - (last_resync or healed_at), 2)
    return row


async def one_run(bridge: netns.Bridge, work: Path, cut_seconds: float, *, warmup_epochs: int = 3,
                  heal_timeout: float = 120.0, settle_seconds: float = 20.0, start_timeout: float = 120.0,
                  exit_timeout: float = 120.0, log=print, raise_errors: bool = False) -> dict:
    """Start the peers, cut, heal, wait for one swarm and `settle_seconds` more, end them; measure (see the module's
    docstring). A swarm that misbehaves (a wait that times out, a peer that fails) ends the run: `error` says what
    went wrong and the row what was seen, or, with `raise_errors` (tests), the error is raised with the peer's log."""
    from peer.telemetry.events import EpochEnded
    from peer.testing import PeerFailed, Swarm, max_parameter_difference

    row: dict = {"cut_seconds": cut_seconds, "error": None}
    cut_at = healed_at = ended_at = None
    async with Swarm(work, *TASK_ARGS, "--max-epochs", "5000", fast=True) as swarm:
        swarm.args += swarm.ends_on_request()
        try:
            peers = await netns.start_peers(swarm, bridge, PEERS, start_timeout)
            await swarm.all_reached(warmup_epochs, timeout=start_timeout)
            bridge.cut(*HALVES)
            cut_at = time.time()
            log(f"cut {HALVES[0]} from {HALVES[1]} at epoch {max(peer.epoch for peer in peers)}")
            await asyncio.sleep(cut_seconds)
            # the heal's time is taken first: a peer can reconnect while the restore is still being applied (in CI,
            # under suite load, one said it had rejoined 0.08 s before the restore returned)
            healed_at = time.time()
            bridge.restore()
            log(f"healed at epochs {[peer.epoch for peer in peers]}")
            await asyncio.gather(*(peer.wait_for(
                EpochEnded, lambda event: event.peers >= PEERS and event.time >= healed_at, timeout=heal_timeout,
                what=f"an epoch with all {PEERS} peers") for peer in peers))
            log(f"one swarm {time.time() - healed_at:.1f}s after the heal; settling for {settle_seconds:g}s")
            await asyncio.sleep(settle_seconds)
            ended_at = time.time()
            swarm.end_soon(peers)
            row["exit_codes"] = await swarm.all_exited(timeout=exit_timeout)
            states = [peer.model_state() for peer in peers]
            row["parameter_differences"] = [max_parameter_difference(states[0], state) for state in states[1:]]
            row["max_parameter_difference"] = max(row["parameter_differences"])
        except (PeerFailed, TimeoutError, asyncio.TimeoutError) as e:
            if raise_errors:
                raise
            row["error"] = str(e).splitlines()[0][:300]
        finally:
            bridge.restore()
        events = [peer.events for peer in swarm.training_peers]
        row["final_epochs"] = [peer.epoch for peer in swarm.training_peers]
        row["peer_ids"] = [_peer_id(peer) for peer in swarm.training_peers]
        row["split_logged"] = ["the swarm looks split" in peer.log() for peer in swarm.training_peers]
        row["excluded"] = [[event.peer_id for event in peer if event.event == "excluded"] for peer in events]
    if cut_at is not None and healed_at is not None:
        row.update(measure(events, cut_at, healed_at, ended_at or time.time()))
    return row


def _peer_id(peer) -> Optional[str]:
    try:
        return peer.peer_id
    except RuntimeError:  # never became ready
        return None


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--cut-seconds", type=float, default=None, help="how long the halves are cut off (default 40; "
                                                                   "smoke 10)")
    p.add_argument("--runs", type=int, default=None, help="repetitions (default 3; quick and smoke 1)")
    p.add_argument("--settle-seconds", type=float, default=None,
                   help="how long the swarm runs on after it is one again (default 30; quick 20, smoke 5)")
    args = p.parse_args(argv)
    mode = args.mode
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # leaves the namespaces clean
    run = common.Run(NAME, mode, args.output)
    cut_seconds = args.cut_seconds or common.by_mode(mode, smoke=10.0, quick=40.0, full=40.0)
    runs = args.runs or common.by_mode(mode, smoke=1, quick=1, full=3)
    settle = args.settle_seconds if args.settle_seconds is not None else common.by_mode(mode, smoke=5.0, quick=20.0,
                                                                                         full=30.0)
    results: Dict = {"task": TASK_ARGS[1], "peers": PEERS, "halves": [list(half) for half in HALVES],
                     "cut_seconds": cut_seconds, "runs": [], "skipped": None}
    if netns.finished_without_namespaces(run, NAME, results):
        return 0
    netns.remove_stale()
    rows: List[dict] = []
    with tempfile.TemporaryDirectory(prefix="swarmtrain-partition-") as work, netns.Bridge(PEERS) as bridge:
        for index in range(runs):
            row = asyncio.run(one_run(bridge, Path(work) / f"run-{index}", cut_seconds, settle_seconds=settle,
                                      log=run.log))
            run.log(f"run {index}: one swarm {row.get('one_swarm_after_seconds')}s after the heal, rejoined "
                    f"{row.get('rejoined_after_seconds')}, epochs during the cut {row.get('epochs_during_cut')}, "
                    f"max parameter difference {row.get('max_parameter_difference')}"
                    + (f", error {row['error']}" if row["error"] else ""))
            rows.append(row)
    failed = [str(index) for index, row in enumerate(rows) if row["error"] or any(row.get("exit_codes") or [1])]
    if failed:
        run.note(f"runs that did not end cleanly: {', '.join(failed)}")
    one_swarm = common.stats(row.get("one_swarm_after_seconds") for row in rows)
    rejoined = common.stats(max(row["rejoined_after_seconds"]) for row in rows
                            if row.get("rejoined_after_seconds") and None not in row["rejoined_after_seconds"])
    results.update(runs=rows, one_swarm_after_seconds=one_swarm, rejoined_after_seconds=rejoined)
    differences = [row.get("max_parameter_difference") for row in rows]
    run.finish(results, f"{NAME} ({PEERS} peers, {cut_seconds:g}s cut, {len(rows)} run(s)): one swarm "
                        f"{_fmt(one_swarm['median'])}s after the heal (median; DHT rejoined "
                        f"{_fmt(rejoined['median'])}s), final max parameter difference {differences}")
    return 0


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
