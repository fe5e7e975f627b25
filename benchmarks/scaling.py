"""Time to a fixed validation loss with 1, 2 and 4 peers, and how well delayed updates hide communication.

**Scaling.** For each peer count N (1, 2, 4), N real `peer start` processes on 127.0.0.1 train
the default task (`bytelm-tiny` in quick mode) with the same global target batch, started
together (``--min-peers N``) with the asyncio harness (peer/testing/). Each peer's `epoch`
events are read as they are written; the run stops (SIGTERM, a graceful stop) at the first one whose
``val_loss`` is at or below the target. Reported: ``time_to_target_seconds`` (from the moment the
last peer was a member of the swarm, its `ready` event, to that `epoch` event),
``startup_seconds`` (launch to that moment), the epoch and samples it took, and ``speedup_vs_1``
(time with 1 peer / time with N).

Each peer gets an equal share of the machine: ``share = max(1, cores // max(N))`` cores, its
own disjoint set (``taskset``, and torch threads = share) while N * share <= cores; beyond that
the sets are reused round-robin and the row says ``oversubscribed: true``. On 2 cores this means
1 core per peer: 1 and 2 peers have a core each, 4 peers share the 2 cores (two per core), so
the 4-peer row measures sharing, not scaling. Counts run in the order 1, 2, 4, then reversed
in the next repeat.

**Communication hiding.** Three 2-peer-or-fewer runs of fixed length, interleaved with the
same care, each peer on its own core share; the local step rate is samples / time on the
training thread (phase totals from ``--summary-json``; validation excluded):

- ``alone``: 1 peer, ``--offload-optimizer --delay-updates``: it steps but never averages;
- ``delay_updates``: 2 peers, same flags: averaging runs in the background during the next steps;
- ``blocking``: 2 peers, ``--offload-optimizer`` only: the step waits for each round.

``hiding_ratio`` = rate(delay_updates) / rate(alone): 1.0 means averaging is fully hidden. The
hiding target batch is large enough that one epoch of local compute (about 1.5-3 s per peer
on bytelm-tiny) outlasts a round (1 s matchmaking + all-reduce): with epochs shorter than a
round, the next update must wait for the previous round and nothing can be hidden.

Usage (from the repository root)::

    python -m benchmarks.scaling --quick     # bytelm-tiny, val loss 3.6, target batch 256
    python -m benchmarks.scaling             # bytelm, val loss 3.0, target batch 1024 (long)
    python -m benchmarks.scaling --smoke     # bytelm-tiny, 1 and 2 peers, loose target, no hiding runs; for tests
    # a transformers model on one GPU shared by 1 then 2 peers (its text: the stdlib's sources):
    python -m benchmarks.scaling --quick --task hf-causal-lm --peers 1,2 --skip-hiding --target-val-loss 3.0 \
        --target-batch-size 2048 --peer-args "--device cuda --precision bf16 --model-config llama-20m --batch-size 64"
    # one GPU shared by 1 then 2 peers, in bf16:
    python -m benchmarks.scaling --peers 1,2 --skip-hiding --peer-args "--device cuda --precision bf16"

JSON ``results``: ``task``, ``target_val_loss``, ``target_batch_size``, ``cores``, ``cores_per_peer``, ``peer_args``,
``run_id`` (it seeds the initial weights: runs of one invocation start from the same ones),
``pinning`` (``taskset`` or a reason it is off), ``repeats``; ``scaling``: one row per (peers, repeat)
with ``reached``, ``time_to_target_seconds``, ``startup_seconds``, ``epoch``, ``samples``,
``val_loss``, ``cpu_sets``, ``oversubscribed``, ``exit_codes``, ``curve`` ([seconds since ready, epoch, val_loss] per
validated epoch, the lowest any peer saw); ``speedup_vs_1``: peers -> median speedup;
``hiding``: ``{skipped, reason}`` or ``runs.<alone|delay_updates|blocking>`` (``peers``, ``flags``,
``local_samples_per_second`` per peer, ``averaging_rounds``), ``hiding_ratio``, ``blocking_ratio``.
"""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common
from peer.telemetry.events import EpochEnded, Ready
from peer.testing import Peer, PeerFailed, Swarm

NAME = "scaling"
STOP_GRACE_SECONDS = 45.0
HIDING_RUNS = {
    "alone": (1, ["--offload-optimizer", "--delay-updates"]),
    "delay_updates": (2, ["--offload-optimizer", "--delay-updates"]),
    "blocking": (2, ["--offload-optimizer"]),
}


async def stop_all(peers: Sequence[Peer]) -> List[Optional[int]]:
    """Ask every peer to stop at once (so none waits for another): SIGTERM, a grace period, then SIGKILL."""
    return list(await asyncio.gather(*(peer.stop(STOP_GRACE_SECONDS) for peer in peers)))


def ready_time(peer: Peer) -> float:
    """When it became a member of the swarm (its `ready` event; wall clock)."""
    return next(event.time for event in peer.events if isinstance(event, Ready))


def epochs(peer: Peer) -> List[EpochEnded]:
    return [event for event in peer.events if isinstance(event, EpochEnded)]


def loss_curve(peers: Sequence[Peer], ready: float) -> List[List[float]]:
    """[seconds since the last peer was ready, epoch, val_loss] of every validated epoch, the lowest loss any peer
    saw at that epoch: another target's time is read off it afterwards."""
    best: Dict[int, EpochEnded] = {}
    for epoch in (epoch for peer in peers for epoch in epochs(peer) if epoch.val_loss is not None):
        if epoch.epoch not in best or epoch.val_loss < best[epoch.epoch].val_loss:
            best[epoch.epoch] = epoch
    return [[round(epoch.time - ready, 2), number, round(epoch.val_loss, 4)] for number, epoch in sorted(best.items())]


def cpu_plan(peers: int, cores: List[int], share: int, pinning: bool) -> (List[Optional[List[int]]], bool):
    """CPU set of each peer: disjoint sets of `share` cores while they last, then round-robin."""
    sets = [cores[i * share:(i + 1) * share] for i in range(max(1, len(cores) // share))]
    oversubscribed = peers > len(sets)
    if not pinning:
        return [None] * peers, oversubscribed
    return [sets[i % len(sets)] for i in range(peers)], oversubscribed


async def launch(swarm: Swarm, peers: int, extra: List[str], plan, threads: int, start_timeout: float) -> List[Peer]:
    """Start N peers, each on its CPU set (peer 0 first, the others joining it); PeerFailed if one cannot start."""
    def add(index: int, ready: bool):
        prefix = ["taskset", "-c", ",".join(map(str, plan[index]))] if plan[index] else []
        return swarm.add(*extra, "--min-peers", str(peers), prefix=prefix, env={"OMP_NUM_THREADS": str(threads)},
                         ready=ready, timeout=start_timeout)

    first = await add(0, ready=True)
    others = [await add(index, ready=False) for index in range(1, peers)]
    await asyncio.gather(*(peer.ready(start_timeout) for peer in others))
    return [first, *others]


async def scaling_run(run: common.Run, peers: int, repeat: int, settings: dict, base: List[str], work: Path) -> dict:
    plan, oversubscribed = cpu_plan(peers, settings["cores"], settings["cores_per_peer"],
                                    settings["pinning"] == "taskset")
    label = f"scaling-n{peers}-r{repeat}"
    row = {"peers": peers, "repeat": repeat, "cpu_sets": plan, "oversubscribed": oversubscribed, "reached": False}
    async with Swarm(work / label, *base) as swarm:
        try:
            launched = time.time()
            started = await launch(swarm, peers, ["--target-batch-size", str(settings["target_batch_size"])], plan,
                                   settings["cores_per_peer"], settings["start_timeout_seconds"])
            ready = max(ready_time(peer) for peer in started)
            row["startup_seconds"] = round(ready - launched, 2)
            deadline = time.monotonic() + settings["max_seconds"]
            hit = None
            while hit is None and time.monotonic() < deadline:
                hit = next((epoch for peer in started for epoch in epochs(peer)
                            if epoch.val_loss is not None and epoch.val_loss <= settings["target_val_loss"]), None)
                if any(peer.process.poll() is not None for peer in started):
                    break
                await asyncio.sleep(0.2)
            row["curve"] = loss_curve(started, ready)
            if hit:
                row.update(reached=True, time_to_target_seconds=round(hit.time - ready, 2), epoch=hit.epoch,
                           samples=hit.epoch * settings["target_batch_size"], val_loss=hit.val_loss)
            else:
                last = max((epoch for peer in started for epoch in epochs(peer)), default=None,
                           key=lambda epoch: epoch.epoch)
                row.update(epoch=last.epoch if last else 0, val_loss=last.val_loss if last else None)
                row["why_not"] = ("a peer exited early" if any(peer.process.poll() is not None for peer in started)
                                  else f"not reached within {settings['max_seconds']:.0f}s")
        except PeerFailed as e:
            row["why_not"] = str(e).splitlines()[0]
            run.log(str(e))
        finally:
            row["exit_codes"] = await stop_all(swarm.training_peers)
    run.log(f"scaling N={peers} repeat {repeat}: " + (
        f"val_loss {row['val_loss']} at epoch {row['epoch']} after {row['time_to_target_seconds']}s "
        f"(startup {row['startup_seconds']}s)" if row["reached"] else f"target not reached ({row.get('why_not')})"))
    return row


async def hiding_run(run: common.Run, name: str, settings: dict, base: List[str], work: Path, repeat: int) -> dict:
    peers, flags = HIDING_RUNS[name]
    plan, oversubscribed = cpu_plan(peers, settings["cores"], settings["cores_per_peer"],
                                    settings["pinning"] == "taskset")
    label = f"hiding-{name}-r{repeat}"
    row = {"name": name, "peers": peers, "flags": flags, "repeat": repeat, "cpu_sets": plan,
           "oversubscribed": oversubscribed}
    async with Swarm(work / label, *base) as swarm:
        try:
            await launch(swarm, peers, [*flags, "--target-batch-size", str(settings["hiding_target_batch_size"])],
                         plan, settings["cores_per_peer"], settings["start_timeout_seconds"])
            await asyncio.sleep(settings["hiding_seconds"])
        except PeerFailed as e:
            row["error"] = str(e).splitlines()[0]
        finally:
            row["exit_codes"] = await stop_all(swarm.training_peers)
    rates, rounds = [], []
    for peer in swarm.training_peers:
        path = work / label / f"{peer.name}.json"
        if not path.exists():
            continue
        summary = json.loads(path.read_text())
        busy = sum(v for k, v in summary["phase_seconds"].items() if k not in ("checkpoint", "state_sync"))
        if busy > 0:
            rates.append(summary["samples"] / busy)
        rounds.append(summary["averaging_rounds"])
    row.update(local_samples_per_second=[round(r, 2) for r in rates], averaging_rounds=rounds)
    run.log(f"hiding {name} repeat {repeat}: {row['local_samples_per_second']} samples/s per peer, rounds {rounds}")
    return row


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--task", default=None)
    p.add_argument("--peers", default=None, help="comma-separated peer counts (default 1,2,4; smoke 1,2)")
    p.add_argument("--target-val-loss", type=float, default=None)
    p.add_argument("--target-batch-size", type=int, default=None)
    p.add_argument("--max-seconds", type=float, default=None, help="give up on a scaling run after this long")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--hiding-seconds", type=float, default=None, help="length of each communication-hiding run")
    p.add_argument("--skip-hiding", action="store_true")
    p.add_argument("--run-id", default=None, help="the runs' --run-id, which seeds the model's initial weights "
                                                  "(default: one per invocation); give the same to compare "
                                                  "invocations from one starting point")
    p.add_argument("--peer-args", default="", help="more `peer start` flags for every peer, as one string, e.g. "
                                                   "\"--device cuda --precision bf16\" (peers then share that GPU)")
    args = p.parse_args(argv)
    mode = args.mode
    peer_counts = [int(x) for x in
                   (args.peers or common.by_mode(mode, smoke="1,2", quick="1,2,4", full="1,2,4")).split(",")]
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // max(peer_counts))
    settings = {
        "task": args.task or common.by_mode(mode, smoke="bytelm-tiny", quick="bytelm-tiny", full="bytelm"),
        "target_val_loss": args.target_val_loss or common.by_mode(mode, smoke=5.0, quick=3.6, full=3.0),
        "target_batch_size": args.target_batch_size or common.by_mode(mode, smoke=64, quick=256, full=1024),
        "hiding_target_batch_size": common.by_mode(mode, smoke=64, quick=1024, full=4096),
        "max_seconds": args.max_seconds or common.by_mode(mode, smoke=40.0, quick=75.0, full=1800.0),
        "hiding_seconds": args.hiding_seconds or common.by_mode(mode, smoke=8.0, quick=20.0, full=60.0),
        "repeats": args.repeats or common.by_mode(mode, smoke=1, quick=1, full=2),
        "start_timeout_seconds": 120.0,
        "matchmaking_seconds": 1.0,
        "cores": cores,
        "cores_per_peer": share,
        "pinning": "taskset" if shutil.which("taskset") else "off: taskset is not installed",
        "peer_args": shlex.split(args.peer_args),
        "run_id": args.run_id or f"bench-scaling-{os.getpid()}",
    }
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run = common.Run(NAME, mode, args.output)
    if len(cores) < max(peer_counts) * share:
        run.note(f"{len(cores)} cores for up to {max(peer_counts)} peers at {share} core(s) each: runs with more than "
                 f"{len(cores) // share} peers share cores (oversubscribed), so they measure sharing, not scaling")
    base = ["--task", settings["task"], "--run-id", settings["run_id"], "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0", "--matchmaking-seconds", str(settings["matchmaking_seconds"]),
            "--averaging-timeout-seconds", "10", "--data-workers", "1", "--val-batches", "4", "--metrics-port", "off",
            "--checkpoint-every-epochs", "100000", "--min-peers-timeout-seconds", "120", *settings["peer_args"]]
    rows, hiding_rows = [], []
    with tempfile.TemporaryDirectory(prefix="swarmtrain-scaling-") as tmp:
        work = Path(tmp)
        if settings["task"] == "hf-causal-lm" and "--data" not in settings["peer_args"]:  # nothing to download
            base += ["--data", str(common.stdlib_text_corpus(work / "corpus"))]
        for repeat in range(settings["repeats"]):
            for peers in common.interleaved(peer_counts, repeat):
                rows.append(asyncio.run(scaling_run(run, peers, repeat, settings, base, work)))
            if not args.skip_hiding and mode != "smoke":
                for name in common.interleaved(list(HIDING_RUNS), repeat):
                    hiding_rows.append(asyncio.run(hiding_run(run, name, settings, base, work, repeat)))

    speedup: Dict[str, Optional[float]] = {}
    for peers in peer_counts:
        pairs = [(one["time_to_target_seconds"], row["time_to_target_seconds"])
                 for row in rows if row["peers"] == peers and row["reached"]
                 for one in rows if one["peers"] == 1 and one["repeat"] == row["repeat"] and one["reached"]]
        speedup[str(peers)] = common.rounded(common.stats(a / b for a, b in pairs)["median"], 3)
    unreached = [r for r in rows if not r["reached"]]
    if unreached:
        run.note(f"{len(unreached)} scaling run(s) did not reach val_loss {settings['target_val_loss']}: "
                 + "; ".join(f"N={r['peers']}: {r.get('why_not')}" for r in unreached))

    if args.skip_hiding or mode == "smoke":
        hiding = {"skipped": True, "reason": "--skip-hiding" if args.skip_hiding else "left out in smoke mode"}
    else:
        def rate(name: str) -> Optional[float]:
            values = [v for r in hiding_rows if r["name"] == name for v in r["local_samples_per_second"]]
            return common.stats(values)["median"]

        alone, delayed, blocking = rate("alone"), rate("delay_updates"), rate("blocking")
        hiding = {
            "skipped": False,
            "runs": hiding_rows,
            "local_samples_per_second": {"alone": alone, "delay_updates": delayed, "blocking": blocking},
            "hiding_ratio": common.rounded(delayed / alone, 3) if delayed and alone else None,
            "blocking_ratio": common.rounded(blocking / alone, 3) if blocking and alone else None,
            "rate_definition": "samples / seconds in the training thread's phases (validation, checkpoint and "
                               "state download excluded), per peer, median over peers and repeats",
        }
        for r in hiding_rows:
            if r["name"] != "alone" and not any(rounds.get("ok") for rounds in r["averaging_rounds"]):
                run.note(f"hiding run {r['name']} completed no averaging round; its rate says nothing about hiding")
    results = {**{k: v for k, v in settings.items()}, "scaling": rows, "speedup_vs_1": speedup, "hiding": hiding}
    times = {str(r["peers"]): r.get("time_to_target_seconds") for r in rows if r["repeat"] == 0}
    line = (f"{NAME} ({settings['task']}, val_loss <= {settings['target_val_loss']}, {len(cores)} cores, "
            f"{share} per peer): time to target "
            + ", ".join(f"N={k}: " + ("not reached" if v is None else f"{v}s") for k, v in times.items())
            + "; speedup vs 1 peer " + ", ".join(f"N={k}: {common.fmt_ratio(v)}" for k, v in speedup.items())
            + (f"; delay-updates hiding ratio {common.fmt_ratio(hiding.get('hiding_ratio'))}"
               f" (blocking {common.fmt_ratio(hiding.get('blocking_ratio'))})" if not hiding["skipped"] else ""))
    run.finish(results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
