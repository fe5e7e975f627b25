"""Honest peers against hostile ones, side by side with a clean swarm: speed, loss, and how fast each is handled.

Every run starts honest `peer start` processes on 127.0.0.1 (bytelm-tiny, one run id) and others, by scenario:

- ``none``: three honest peers and an honest bystander training the same task in *another* run: it costs the
  machine what an attacker costs, so that the ratios measure the protocol, not the CPU share of a fourth process;
- ``mean``: the same, with ``--robust-aggregation mean`` (the default before the trimmed mean): what the default
  rule costs an honest swarm is ``none`` against ``mean``;
- ``nan``, ``scaled-1e4``, ``sign-flipped``: three honest peers and an attacker whose gradients are NaN (sent past
  its own guard), multiplied by 1e4, or by -1 (`--inject-faults`, peer/testing/faults.py's HOSTILE_PEERS);
- ``over-claimer``: an attacker built only through the Task API, which reports ten times the samples it trains
  on and ascends its loss (tests/tasks_for_tests.py's make_overclaiming_task);
- ``forged-manifest``: the clean swarm, with three forged run manifests (target batch 999) stored by bare DHT
  clients once the first honest peer is up, before the others join with its --run-owner;
- ``hostile-majority``: two honest peers and three colluders that send their gradients flipped and tripled and
  exclude nobody: the honest peers are to notice (an ``updates_refused`` event) and train on.

What is read from the peers' events, per run:

- ``epochs_per_minute``: the honest peers' median rate over the measured window; ``..._after_exclusion`` from the
  moment the last honest peer excluded the attacker (or refused the majority);
- ``seconds_to_exclusion`` / ``seconds_to_refusal``: from the moment all processes were ready to each honest
  peer's first ``excluded`` / ``updates_refused`` event (null where it never came);
- ``wrongly_excluded``: exclusions of anyone but an attacker (false positives of the drop rules);
- ``val_loss``: the honest peers' median validation loss at their last epoch; ``val_loss_vs_clean``: minus the
  ``none`` run's of the same repeat (at the same wall time: a slower swarm is also less trained);
- ``ratio`` and ``ratio_after_exclusion``: the rates over the same repeat's ``none`` run.

Runs are interleaved (each scenario once per repeat, the order reversed every other repeat).

Usage (from the repository root)::

    python -m benchmarks.robustness --quick     # 60 s per run, one repeat: about 14 minutes
    python -m benchmarks.robustness             # 150 s per run, two repeats
    python -m benchmarks.robustness --smoke     # scaled-1e4 alone, 20 s, no ratios; for tests

JSON ``results``: ``task``, ``target_batch_size``, ``seconds_per_run``, ``repeats``, ``runs`` (one row per run:
``attack``, ``repeat``, the fields above, ``epochs`` per honest peer, ``exit_codes``), and ``summary.<attack>``:
the medians over repeats.
"""
from __future__ import annotations

import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from averaging.registry import DEFAULT_STRATEGY
from benchmarks import common
from benchmarks.scaling import epochs, ready_time, stop_all
from dht.keys import SwarmKeys
from peer.telemetry.events import PeerExcluded, Ready, UpdatesRefused
from peer.testing import Peer, PeerFailed, Swarm
from peer.testing.faults import HOSTILE_PEERS, FaultPlan
from peer.testing.forgery import forge_manifests

NAME = "robustness"


@dataclass(frozen=True)
class Scenario:
    honest: int = 3
    attackers: int = 0
    attacker_args: Tuple[str, ...] = ()
    honest_args: Tuple[str, ...] = ()
    forged_manifests: int = 0


def _injected(plan: FaultPlan) -> Tuple[str, ...]:
    return ("--inject-faults", plan.model_dump_json())


SCENARIOS = {
    "none": Scenario(),
    "mean": Scenario(honest_args=("--robust-aggregation", "mean")),
    **{attack: Scenario(attackers=1, attacker_args=_injected(plan)) for attack, plan in HOSTILE_PEERS.items()},
    "over-claimer": Scenario(attackers=1, attacker_args=("--task", "tests.tasks_for_tests:make_overclaiming_task")),
    "forged-manifest": Scenario(forged_manifests=3),
    "hostile-majority": Scenario(honest=2, attackers=3, attacker_args=(
        *_injected(FaultPlan(gradient_factor=-3.0)), "--exclude-after", "1000", "--exclude-window", "1000")),
}


async def start_swarm(swarm: Swarm, scenario: Scenario, run_id: str, start_timeout: float,
                      squatter_keys: Path) -> Tuple[List[Peer], List[Peer]]:
    """The honest peers and the others (attackers, or the bystander); PeerFailed if one does not come up."""
    run = ["--run-id", run_id, "--min-peers", str(scenario.honest + scenario.attackers)]
    first = await swarm.add(*run, *scenario.honest_args, timeout=start_timeout)
    if scenario.forged_manifests:
        forge_manifests(first.address, SwarmKeys.for_run(run_id), {"task": "bytelm-tiny", "target_batch_size": 999,
                        "averaging": DEFAULT_STRATEGY}, scenario.forged_manifests, squatter_keys)
    honest = [first] + [await swarm.add(*run, *scenario.honest_args, ready=False) for _ in range(1, scenario.honest)]
    if scenario.attackers:
        others = [await swarm.add(*run, *scenario.attacker_args, ready=False) for _ in range(scenario.attackers)]
    else:
        others = [await swarm.add("--run-id", f"{run_id}-bystander", join=False, ready=False)]
    await asyncio.gather(*(peer.ready(start_timeout) for peer in [*honest[1:], *others]))
    return honest, others


def epochs_per_minute(peer: Peer, since: float, until: float) -> Optional[float]:
    """The rate of the peer's `epoch` events between two moments (None with fewer than two)."""
    inside = [event for event in epochs(peer) if since <= event.time <= until]
    if len(inside) < 2 or inside[-1].time <= inside[0].time:
        return None
    return 60.0 * (inside[-1].epoch - inside[0].epoch) / (inside[-1].time - inside[0].time)


def first_time(peer: Peer, kind: type) -> Optional[float]:
    return next((event.time for event in peer.events if isinstance(event, kind)), None)


def median(values) -> Optional[float]:
    values = [value for value in values if value is not None]
    return round(statistics.median(values), 3) if values else None


def since(moments: Sequence[Optional[float]], start: float) -> List[Optional[float]]:
    return [round(at - start, 1) if at is not None else None for at in moments]


async def measure(run: common.Run, attack: str, repeat: int, settings: dict, base: List[str], root: Path) -> dict:
    scenario, row = SCENARIOS[attack], {"attack": attack, "repeat": repeat}
    async with Swarm(root / f"{attack}-r{repeat}", *base) as swarm:
        try:
            honest, others = await start_swarm(swarm, scenario, f"bench-robust-{os.getpid()}-{attack}-{repeat}",
                                               settings["start_timeout_seconds"], root / f"squatter-{repeat}")
            ready = max(ready_time(peer) for peer in [*honest, *others])
            await asyncio.sleep(settings["seconds_per_run"])
            end = time.time()
        except PeerFailed as e:
            row["error"] = str(e).splitlines()[0]
            run.log(str(e))
            return row
        finally:
            row["exit_codes"] = await stop_all(swarm.training_peers)
    attacker_ids = {event.peer_id for peer in others[:scenario.attackers] for event in peer.events
                    if isinstance(event, Ready)}
    excluded = [event.peer_id for peer in honest for event in peer.events if isinstance(event, PeerExcluded)]
    excluded_at = [first_time(peer, PeerExcluded) for peer in honest]
    refused_at = [first_time(peer, UpdatesRefused) for peer in honest]
    handled = refused_at if attack == "hostile-majority" else excluded_at
    after = ready if not scenario.attackers else (max(handled) if all(handled) else None)
    last_losses = [epochs(peer)[-1].val_loss for peer in honest if epochs(peer)]
    row.update(
        epochs=[epochs(peer)[-1].epoch if epochs(peer) else 0 for peer in honest],
        epochs_per_minute=median(epochs_per_minute(peer, ready, end) for peer in honest),
        epochs_per_minute_after_exclusion=(median(epochs_per_minute(peer, after, end) for peer in honest)
                                           if after is not None else None),
        wrongly_excluded=sum(peer_id not in attacker_ids for peer_id in excluded),
        seconds_to_exclusion=since(excluded_at, ready) if scenario.attackers else None,
        seconds_to_refusal=since(refused_at, ready),
        val_loss=median(last_losses),
    )
    run.log(f"{attack} repeat {repeat}: {row['epochs_per_minute']} epochs/min "
            f"({row['epochs_per_minute_after_exclusion']} after exclusion), val loss {row['val_loss']}, "
            f"exclusion after {row['seconds_to_exclusion']} s, refusal after {row['seconds_to_refusal']} s")
    return row


def compare_with_clean(rows: List[dict]) -> None:
    for row in rows:
        clean = next((other for other in rows if other["attack"] == "none" and other["repeat"] == row["repeat"]), {})
        for key, rate in (("ratio", "epochs_per_minute"), ("ratio_after_exclusion",
                                                           "epochs_per_minute_after_exclusion")):
            numerator, denominator = row.get(rate), clean.get("epochs_per_minute")
            row[key] = round(numerator / denominator, 3) if numerator is not None and denominator else None
        loss, clean_loss = row.get("val_loss"), clean.get("val_loss")
        row["val_loss_vs_clean"] = round(loss - clean_loss, 3) if loss is not None and clean_loss is not None else None


def summarize(run: common.Run, attacks: List[str], rows: List[dict]) -> dict:
    summary = {}
    for attack in attacks:
        mine = [row for row in rows if row["attack"] == attack]
        summary[attack] = {
            "ratio": median(row.get("ratio") for row in mine),
            "ratio_after_exclusion": median(row.get("ratio_after_exclusion") for row in mine),
            "val_loss": median(row.get("val_loss") for row in mine),
            "val_loss_vs_clean": median(row.get("val_loss_vs_clean") for row in mine),
            "wrongly_excluded": sum(row.get("wrongly_excluded") or 0 for row in mine),
            "seconds_to_exclusion": median(seconds for row in mine for seconds in row.get("seconds_to_exclusion")
                                           or ()),
            "seconds_to_refusal": median(seconds for row in mine for seconds in row.get("seconds_to_refusal") or ()),
        }
        if SCENARIOS[attack].attackers and attack != "hostile-majority" and any(
                None in (row.get("seconds_to_exclusion") or [None]) for row in mine):
            run.note(f"{attack}: not every honest peer excluded the attacker within its run")
        if attack == "hostile-majority" and any(None in (row.get("seconds_to_refusal") or [None]) for row in mine):
            run.note("hostile-majority: not every honest peer refused the majority within its run")
    return summary


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--seconds", type=float, default=None, help="measured seconds per run")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--attacks", default=None, help=f"comma-separated scenarios, of {', '.join(SCENARIOS)}")
    args = p.parse_args(argv)
    mode = args.mode
    attacks = args.attacks.split(",") if args.attacks else common.by_mode(
        mode, smoke=["scaled-1e4"], quick=list(SCENARIOS), full=list(SCENARIOS))
    unknown = [attack for attack in attacks if attack not in SCENARIOS]
    if unknown:
        print(f"error: --attacks {','.join(unknown)}: not a scenario; choose from {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    settings = {
        "task": "bytelm-tiny",
        "target_batch_size": 48,
        "seconds_per_run": args.seconds or common.by_mode(mode, smoke=20.0, quick=60.0, full=150.0),
        "repeats": args.repeats or common.by_mode(mode, smoke=1, quick=1, full=2),
        "attacks": attacks,
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
    compare_with_clean(rows)
    summary = summarize(run, settings["attacks"], rows)
    if "none" not in settings["attacks"]:
        run.note("no clean run (smoke mode): every ratio is null")
    run.note("single reducer per round: bytelm-tiny fits in one all-reduce part, so each honest peer judges "
             "the attacker only in the rounds it reduces")
    run.note("hostile-majority runs 5 processes, the others 4: its ratios also carry a fifth process's CPU share")
    results = {**settings, "runs": rows, "summary": summary, "goal": {"ratio_after_exclusion_min": 0.8}}
    line = f"{NAME} (bytelm-tiny, honest peers against others): " + "; ".join(
        f"{attack} {common.fmt_ratio(values['ratio'])} (val loss {values['val_loss_vs_clean']} vs clean; handled at "
        f"{values['seconds_to_exclusion'] if attack != 'hostile-majority' else values['seconds_to_refusal']} s)"
        for attack, values in summary.items() if attack != "none"
    ) + f"; honest peers excluded wrongly {sum(values['wrongly_excluded'] for values in summary.values())} times"
    run.finish(results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
