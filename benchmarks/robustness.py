"""Honest peers' training speed with one malicious peer, as a ratio to the same swarm without one.

Each run starts three honest `peer start` processes on 127.0.0.1 (bytelm-tiny, one run id) and a
fourth process that is either

- ``none``: an honest bystander training the same task in *another* run: it costs the machine what an
  attacker costs, so that the ratio measures the protocol, not the CPU share of a fourth process;
- ``nan``, ``scaled-1e4``, ``sign-flipped``: an attacker in the honest peers' run whose gradients are
  NaN (sent past its own guard), multiplied by 1e4, or multiplied by -1 (`--inject-faults` with
  peer/testing/faults.py's HOSTILE_PEERS).

The peers run under the asyncio harness (peer/testing/); what they do is read from their events.
Reported per run:

- ``epochs_per_minute``: the honest peers' median rate over the whole measured window;
- ``epochs_per_minute_after_exclusion``: the same from the moment the last honest peer excluded the
  attacker (for ``none``: the whole window again);
- ``seconds_to_exclusion``: from the moment all four processes were ready to each honest peer's first
  `excluded` event (null where a peer never excluded it);
- ``wrongly_excluded``: how many times an honest peer excluded a peer other than the attacker (for
  ``none``: any exclusion at all): false positives of the drop rules;
- ``ratio`` and ``ratio_after_exclusion``: the rates over the same repeat's ``none`` run.

Runs are interleaved (none, nan, scaled, flipped, then reversed), and the issue's goal is a ratio of
at least 0.8 once the attacker is excluded.

Usage (from the repository root)::

    python -m benchmarks.robustness --quick     # 60 s per run, one repeat: about 6 minutes
    python -m benchmarks.robustness             # 150 s per run, two repeats
    python -m benchmarks.robustness --smoke     # scaled-1e4 alone, 20 s, no ratios; for tests

JSON ``results``: ``task``, ``target_batch_size``, ``seconds_per_run``, ``repeats``, ``runs`` (one row per
run: ``attack``, ``repeat``, the fields above, ``epochs`` per honest peer, ``exit_codes``), and
``summary.<attack>``: median ``ratio``, ``ratio_after_exclusion`` and ``seconds_to_exclusion`` over repeats.
"""
from __future__ import annotations

import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common
from benchmarks.scaling import epochs, ready_time, stop_all
from peer.telemetry.events import PeerExcluded, Ready
from peer.testing import Peer, PeerFailed, Swarm
from peer.testing.faults import HOSTILE_PEERS

NAME = "robustness"
HONEST_PEERS = 3


async def start_swarm(swarm: Swarm, attack: str, run_id: str, start_timeout: float) -> List[Peer]:
    """Three honest peers and the fourth process; PeerFailed if one does not come up."""
    run = ["--run-id", run_id, "--min-peers", str(HONEST_PEERS + (attack != "none"))]
    first = await swarm.add(*run, timeout=start_timeout)
    honest = [await swarm.add(*run, ready=False) for _ in range(1, HONEST_PEERS)]
    if attack == "none":
        fourth = await swarm.add("--run-id", f"{run_id}-bystander", join=False, ready=False)
    else:
        fourth = await swarm.add(*run, "--inject-faults", HOSTILE_PEERS[attack].model_dump_json(), ready=False)
    peers = [first, *honest, fourth]
    await asyncio.gather(*(peer.ready(start_timeout) for peer in peers[1:]))
    return peers


def epochs_per_minute(peer: Peer, since: float, until: float) -> Optional[float]:
    """The rate of the peer's `epoch` events between two moments (None with fewer than two)."""
    inside = [event for event in epochs(peer) if since <= event.time <= until]
    if len(inside) < 2 or inside[-1].time <= inside[0].time:
        return None
    return 60.0 * (inside[-1].epoch - inside[0].epoch) / (inside[-1].time - inside[0].time)


def exclusions(peer: Peer) -> List[PeerExcluded]:
    return [event for event in peer.events if isinstance(event, PeerExcluded)]


def median(values) -> Optional[float]:
    values = [value for value in values if value is not None]
    return round(statistics.median(values), 3) if values else None


async def measure(run: common.Run, attack: str, repeat: int, settings: dict, base: List[str], root: Path) -> dict:
    row = {"attack": attack, "repeat": repeat}
    async with Swarm(root / f"{attack}-r{repeat}", *base) as swarm:
        try:
            peers = await start_swarm(swarm, attack, f"bench-robust-{os.getpid()}-{attack}-{repeat}",
                                      settings["start_timeout_seconds"])
            ready = max(ready_time(peer) for peer in peers)
            await asyncio.sleep(settings["seconds_per_run"])
            end = time.time()
        except PeerFailed as e:
            row["error"] = str(e).splitlines()[0]
            run.log(str(e))
            return row
        finally:
            row["exit_codes"] = await stop_all(swarm.training_peers)
    honest = peers[:HONEST_PEERS]
    attacker_id = None if attack == "none" else next(event.peer_id for event in peers[HONEST_PEERS].events
                                                     if isinstance(event, Ready))
    excluded_ids = [event.peer_id for peer in honest for event in exclusions(peer)]
    excluded_at = [next((event.time for event in exclusions(peer)), None) for peer in honest]
    after = ready if attack == "none" else (max(excluded_at) if all(excluded_at) else None)
    row.update(
        epochs=[epochs(peer)[-1].epoch if epochs(peer) else 0 for peer in honest],
        epochs_per_minute=median(epochs_per_minute(peer, ready, end) for peer in honest),
        epochs_per_minute_after_exclusion=(median(epochs_per_minute(peer, after, end) for peer in honest)
                                           if after is not None else None),
        wrongly_excluded=sum(peer_id != attacker_id for peer_id in excluded_ids),
        seconds_to_exclusion=None if attack == "none" else [
            round(at - ready, 1) if at is not None else None for at in excluded_at],
    )
    run.log(f"{attack} repeat {repeat}: {row['epochs_per_minute']} epochs/min "
            f"({row['epochs_per_minute_after_exclusion']} after exclusion), "
            f"exclusion after {row['seconds_to_exclusion']} s")
    return row


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--seconds", type=float, default=None, help="measured seconds per run")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args(argv)
    mode = args.mode
    settings = {
        "task": "bytelm-tiny",
        "target_batch_size": 48,
        "seconds_per_run": args.seconds or common.by_mode(mode, smoke=20.0, quick=60.0, full=150.0),
        "repeats": args.repeats or common.by_mode(mode, smoke=1, quick=1, full=2),
        "attacks": common.by_mode(mode, smoke=["scaled-1e4"], quick=["none", *HOSTILE_PEERS],
                                  full=["none", *HOSTILE_PEERS]),
        "start_timeout_seconds": 120.0,
    }
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run = common.Run(NAME, mode, args.output)
    base = ["--task", settings["task"], "--target-batch-size", str(settings["target_batch_size"]),
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--matchmaking-seconds", "1", "--averaging-timeout-seconds",
            "10", "--data-workers", "1", "--val-batches", "4", "--metrics-port", "off",
            "--checkpoint-every-epochs", "100000", "--min-peers-timeout-seconds", "120"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarmtrain-robustness-") as tmp:
        for repeat in range(settings["repeats"]):
            for attack in common.interleaved(settings["attacks"], repeat):
                rows.append(asyncio.run(measure(run, attack, repeat, settings, base, Path(tmp))))

    for row in rows:
        baseline = next((other for other in rows if other["attack"] == "none" and other["repeat"] == row["repeat"]),
                        {})
        for key, rate in (("ratio", "epochs_per_minute"), ("ratio_after_exclusion",
                                                           "epochs_per_minute_after_exclusion")):
            numerator, denominator = row.get(rate), baseline.get("epochs_per_minute")
            row[key] = round(numerator / denominator, 3) if numerator is not None and denominator else None
    summary = {}
    for attack in settings["attacks"]:
        mine = [row for row in rows if row["attack"] == attack]
        summary[attack] = {
            "ratio": median(row.get("ratio") for row in mine),
            "ratio_after_exclusion": median(row.get("ratio_after_exclusion") for row in mine),
            "wrongly_excluded": sum(row.get("wrongly_excluded") or 0 for row in mine),
            "seconds_to_exclusion": median(seconds for row in mine for seconds in row.get("seconds_to_exclusion")
                                           or ()),
        }
        if attack != "none" and any(None in (row.get("seconds_to_exclusion") or [None]) for row in mine):
            run.note(f"{attack}: not every honest peer excluded the attacker within its run")
    if "none" not in settings["attacks"]:
        run.note("no control run (smoke mode): every ratio is null")
    run.note("single reducer per round: bytelm-tiny fits in one all-reduce part, so each honest peer judges "
             "the attacker only in the rounds it reduces (about one in four)")
    results = {**settings, "runs": rows, "summary": summary, "goal": {"ratio_after_exclusion_min": 0.8}}
    line = f"{NAME} (bytelm-tiny, 3 honest peers + 1): " + "; ".join(
        f"{attack} {common.fmt_ratio(values['ratio'])} ({common.fmt_ratio(values['ratio_after_exclusion'])} after "
        f"exclusion at {values['seconds_to_exclusion']} s)" for attack, values in summary.items() if attack != "none"
    ) + f"; honest peers excluded wrongly {sum(values['wrongly_excluded'] for values in summary.values())} times"
    run.finish(results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
