"""One slow volunteer in a 3-peer swarm: the epoch rate of the fast peers, with it and without it (issue 30).

Real `peer start` processes (bytelm-tiny, target batch 128, 2 s matchmaking), each in its own network namespace on
one bridge (benchmarks/netns.py), in these setups, interleaved when repeated:

- ``fast-2``: peers 0 and 1 alone, unshaped links: the rate the fast peers have without the slow one;
- ``slow-3``: peers 0 and 1, and peer 2 on a ``--slow-rate`` link (2 Mbit/s both ways, `tc tbf`): the goal is
  that peers 0 and 1 keep at least 0.9 of their ``fast-2`` rate, and that all three end with one state;
- ``slow-3-wait``: the same with ``--straggler-grace-ratio 0``: rounds wait for the slow peer (hivemind's
  behaviour, and this daemon's before the grace window);
- ``fast-3``: three peers on unshaped links: what a third peer costs on this machine's cores, for reference.

Each setup starts its peers together (--min-peers), lets them train ``--warmup-epochs``, then counts the epochs
peers 0 and 1 end during ``--measure-seconds`` (``fast_epochs_per_minute``; the slow peer's own rate as
``slow_epochs_per_minute``). The window runs on until every peer has ended an epoch in it: under load an epoch
can outlast a short window, and a rate of zero would then measure the window, not the peer. Then every peer ends
at one epoch (the harness's end_soon) and ``max_parameter_difference`` compares their final checkpoints with peer
0's (0: one state). From the slow peer's events: ``late_rounds`` (rounds whose contribution its group left out as
late), ``stood_aside`` (it stopped reducing for others) and ``state_downloads``.

Needs root (network namespaces); without it the run is skipped, saying why. Usage (from the repository root)::

    python -m benchmarks.straggler            # 3 rounds of the four setups, 90 s windows
    python -m benchmarks.straggler --quick    # 1 round, 60 s windows (about 6 minutes)
    python -m benchmarks.straggler --smoke    # fast-2 and slow-3, 15 s windows; checks that the script works

JSON ``results``: ``task``, ``slow_rate``, ``measure_seconds``, ``runs`` (one row per setup and round, with
``setup``, the fields above, ``exit_codes`` and ``error``), ``fast_epochs_per_minute`` (setup -> median, min, max),
``ratios`` (``slow-3/fast-2``, ``slow-3-wait/fast-2``, ``slow-3/fast-3``: medians of the ratios paired by round),
``goal`` (the 0.9 of issue 30, and whether it is met) and ``skipped``.
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

NAME = "straggler"
TASK_ARGS = ("--task", "bytelm-tiny", "--target-batch-size", "128", "--matchmaking-seconds", "2")
SLOW = 2  # the index of the peer on the slow link
SETUPS: Dict[str, dict] = {
    "fast-2": dict(peers=2, slow=False, args=()),
    "slow-3": dict(peers=3, slow=True, args=()),
    "slow-3-wait": dict(peers=3, slow=True, args=("--straggler-grace-ratio", "0")),
    "fast-3": dict(peers=3, slow=False, args=()),
}
GOAL = 0.9


def epochs_per_minute(events: Sequence, since: float, until: float) -> float:
    """Epochs a peer ended between `since` and `until`, per minute."""
    ended = {event.epoch for event in events if event.event == "epoch" and since < event.time <= until}
    return round(60.0 * len(ended) / (until - since), 2)


async def one_run(bridge: netns.Bridge, work: Path, setup: str, slow_rate: str, *, warmup_epochs: int = 3,
                  measure_seconds: float = 60.0, start_timeout: float = 120.0, exit_timeout: float = 120.0,
                  raise_errors: bool = False, log=print) -> dict:
    """Run one setup (see the module's docstring) and measure it. A swarm that misbehaves ends the run: `error` says
    what went wrong, or, with `raise_errors` (tests), the error is raised with the peer's log."""
    from peer.telemetry.events import EpochEnded
    from peer.testing import PeerFailed, Swarm, max_parameter_difference

    spec = SETUPS[setup]
    count = spec["peers"]
    row: dict = {"setup": setup, "error": None}
    since = until = None
    bridge.limit_link(SLOW, slow_rate if spec["slow"] else None)
    async with Swarm(work, *TASK_ARGS, "--min-peers", str(count), *spec["args"], "--max-epochs", "5000",
                     fast=True) as swarm:
        swarm.args += swarm.ends_on_request()
        try:
            peers = await netns.start_peers(swarm, bridge, count, start_timeout)
            await swarm.all_reached(warmup_epochs, timeout=start_timeout)
            since = time.time()
            await asyncio.sleep(measure_seconds)
            await asyncio.gather(*(peer.wait_for(EpochEnded, lambda event: event.time > since, timeout=start_timeout,
                                                 what="an epoch in the measuring window") for peer in peers))
            until = time.time()
            log(f"{setup}: epochs {[peer.epoch for peer in peers]} after a {until - since:.0f}s window")
            swarm.end_soon(peers)
            row["exit_codes"] = await swarm.all_exited(timeout=exit_timeout)
            states = [peer.model_state() for peer in peers]
            row["max_parameter_difference"] = max(max_parameter_difference(states[0], state) for state in states[1:])
        except (PeerFailed, TimeoutError, asyncio.TimeoutError) as e:
            if raise_errors:
                raise
            row["error"] = str(e).splitlines()[0][:300]
        finally:
            bridge.limit_link(SLOW, None)
        events = [peer.events for peer in swarm.training_peers]
    if until is not None:
        row.update(measure(events, since, until, spec["slow"]))
    return row


def measure(events: Sequence[list], since: float, until: float, slow: bool) -> dict:
    """The numbers of a run, from each peer's events (in peer order) and the measuring window."""
    rates = [epochs_per_minute(peer, since, until) for peer in events]
    row = {"fast_epochs_per_minute": round(sum(rates[:2]) / 2, 2), "epochs_per_minute": rates}
    if slow:
        slow_events = events[SLOW]
        row["slow_epochs_per_minute"] = rates[SLOW]
        row["late_rounds"] = sum(1 for event in slow_events if event.event == "round" and event.left_out > 0)
        row["stood_aside"] = any(event.event == "reducing" and not event.reduces for event in slow_events)
        row["state_downloads"] = sum(1 for event in slow_events if event.event == "state_downloaded")
    return row


def summarize(rows: List[dict], setups: Sequence[str]) -> dict:
    """Per-setup rates and the ratios the goal is about, paired by round (one round runs every setup once)."""
    def rates(setup: str) -> List[Optional[float]]:
        return [row.get("fast_epochs_per_minute") for row in rows if row["setup"] == setup]

    results = {"fast_epochs_per_minute": {setup: common.stats(rates(setup), 2) for setup in setups}, "ratios": {}}
    for numerator, denominator in (("slow-3", "fast-2"), ("slow-3-wait", "fast-2"), ("slow-3", "fast-3")):
        if numerator in setups and denominator in setups:
            ratios = common.paired_ratios(rates(numerator), rates(denominator))
            results["ratios"][f"{numerator}/{denominator}"] = common.stats(ratios, 3)
    met = results["ratios"].get("slow-3/fast-2", {}).get("median")
    results["goal"] = {"min_ratio": GOAL, "met": None if met is None else met >= GOAL}
    return results


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--slow-rate", default="2mbit", help="the slow peer's link, both ways (tc syntax; default 2mbit)")
    p.add_argument("--measure-seconds", type=float, default=None, help="each setup's window (default 90; quick 60, "
                                                                        "smoke 15)")
    p.add_argument("--rounds", type=int, default=None, help="repetitions of every setup (default 3; quick, smoke 1)")
    args = p.parse_args(argv)
    mode = args.mode
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # leaves the namespaces clean
    run = common.Run(NAME, mode, args.output)
    measure_seconds = args.measure_seconds or common.by_mode(mode, smoke=15.0, quick=60.0, full=90.0)
    rounds = args.rounds or common.by_mode(mode, smoke=1, quick=1, full=3)
    setups = common.by_mode(mode, smoke=["fast-2", "slow-3"], quick=list(SETUPS), full=list(SETUPS))
    results: Dict = {"task": TASK_ARGS[1], "slow_rate": args.slow_rate, "measure_seconds": measure_seconds,
                     "runs": [], "skipped": None}
    if netns.finished_without_namespaces(run, NAME, results):
        return 0
    netns.remove_stale()
    rows: List[dict] = []
    with tempfile.TemporaryDirectory(prefix="swarmtrain-straggler-") as work, netns.Bridge(3) as bridge:
        for round_index in range(rounds):
            for setup in common.interleaved(setups, round_index):
                row = asyncio.run(one_run(bridge, Path(work) / f"{setup}-{round_index}", setup, args.slow_rate,
                                          measure_seconds=measure_seconds, log=run.log))
                row["round"] = round_index
                run.log(f"{setup}: fast peers {row.get('fast_epochs_per_minute')} epochs/min, slow peer "
                        f"{row.get('slow_epochs_per_minute')}, late rounds {row.get('late_rounds')}, max parameter "
                        f"difference {row.get('max_parameter_difference')}"
                        + (f", error {row['error']}" if row["error"] else ""))
                rows.append(row)
    failed = [f"{row['setup']} (round {row['round']})" for row in rows
              if row["error"] or any(row.get("exit_codes") or [1])]
    if failed:
        run.note(f"runs that did not end cleanly: {', '.join(failed)}")
    results.update(runs=rows, **summarize(rows, setups))
    ratio = results["ratios"].get("slow-3/fast-2", {}).get("median")
    waiting = results["ratios"].get("slow-3-wait/fast-2", {}).get("median")
    run.finish(results, f"{NAME} (bytelm-tiny, one of 3 peers at {args.slow_rate}): the fast peers keep "
                        f"{common.fmt_ratio(ratio)}x their epoch rate without it (goal {GOAL}; waiting for it: "
                        f"{common.fmt_ratio(waiting)}x), final max parameter difference "
                        f"{[row.get('max_parameter_difference') for row in rows]}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
