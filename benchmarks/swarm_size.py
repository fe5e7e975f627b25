"""Swarms of 4 to 16 peers on one machine: does each end as one, and what does it cost?

For each swarm size N, `peer swarm --peers N` runs bytelm-tiny on 127.0.0.1 as a new user would
(`--data-workers 0`, each peer on its share of the cores, the target batch max(1024, 128 N), to --max-epochs),
and the benchmark reads what the peers wrote:

- ``ready_seconds``: from the launch of `peer swarm` to each peer's `ready` event (its DHT and averagers are up;
  `peer swarm` starts the others once the first is ready), median and max;
- ``join_seconds``: from the launch to each peer's `joined` event (median and max): `peer swarm` waits for all N
  peers by default (--min-peers), so every peer joins once the last is ready, a start settle and a validation
  later;
- ``epochs_per_minute``: the epochs of the run over the time from the last peer's `joined` event to the last
  peer's final `epoch` event;
- ``rounds``: every peer's round outcomes, counted; ``state_downloads``: `state_downloaded` events, and
  ``download_reasons``: the peers' log lines that start a download, their numbers replaced by N, counted;
- ``max_parameter_difference``: the largest difference of any peer's final model from peer 0's (its last
  checkpoint), and ``states``: how many distinct final states there are (bit for bit: their SHA-256);
  ``without_checkpoint``: the peers that wrote none (they failed early);
- ``pss_mib_per_peer``: the proportional set size of each peer's processes (training, DHT, p2pd, averagers),
  read once while every peer trains (after its first epoch), median over peers, plus an equal share of the
  `peer swarm` process's own (the parent the peers are forked from, which holds the torch they share);
- ``clock_warnings`` and ``asyncio_errors``: lines of the swarm's output that warn of a clock ahead or behind,
  and `Task exception was never retrieved` blocks from hivemind's internals;
- ``group_sizes``: how many rounds averaged groups of each size, and ``distinct_groups``: how many different
  groups (sets of peers) averaged together (with --target-group-size, whether the groups mix);
- ``exit_code`` of `peer swarm` (non-zero if any peer failed), each peer's ``exit_reason``, and where the swarm
  failed, ``output_tail``: the last 4000 characters of its output.

Usage (from the repository root)::

    python -m benchmarks.swarm_size                  # 4, 8, 12 and 16 peers, 8 epochs
    python -m benchmarks.swarm_size --quick          # 4 and 8 peers, 6 epochs
    python -m benchmarks.swarm_size --peers 8 --max-epochs 4
    python -m benchmarks.swarm_size --smoke          # 2 peers, 2 epochs; checks that the script works
    # local-sgd in groups of 4 (docs/strategies.md, grouped rounds):
    python -m benchmarks.swarm_size --peers 16 --peer-args "--averaging local-sgd --target-group-size 4"

JSON ``results``: ``task``, ``max_epochs``, ``peer_args``; ``runs``: one row per swarm size with the fields above
and ``target_batch_size``, ``wall_seconds``.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from statistics import median
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common  # noqa: E402 (after the path fix above)

NAME = "swarm_size"
TASK = "bytelm-tiny"
CLOCK_WARNING = re.compile(r"clock is at least [0-9]+s ahead")  # dht/clock.py
ASYNCIO_ERROR = "Task exception was never retrieved"
DOWNLOAD_LINE = re.compile(r"^\[peer-\d+\] \S+ \w+ [\w.]+: (.*downloading (?:the swarm's|state).*)$", re.MULTILINE)
PEER_ID = re.compile(r"12D3KooW\w+")
RUN_TIMEOUT_SECONDS = 1800.0


def target_batch_size(peers: int) -> int:
    return max(1024, 128 * peers)


def peer_tree_pss_mib(root_pid: int) -> Optional[float]:
    """The PSS of a peer's process and all its descendants, in MiB (None if it is gone)."""
    import psutil

    try:
        processes = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    except psutil.Error:
        return None
    kib = [common.process_memory_kib(process.pid).get("Pss") for process in processes]
    return round(sum(value for value in kib if value) / 1024, 1)


def last_epochs(ckpt: Path, peers: int) -> List[int]:
    from peer.telemetry.events import EpochEnded, read_events

    epochs = []
    for index in range(peers):
        path = ckpt / f"peer-{index}.events.jsonl"
        events = read_events(path)[0] if path.exists() else []
        epochs.append(max((event.epoch for event in events if isinstance(event, EpochEnded)), default=-1))
    return epochs


async def run_swarm(work: Path, peers: int, max_epochs: int, peer_args: List[str], log) -> dict:
    import psutil

    from peer.testing import Swarm

    ckpt, summaries = work / "ckpt", work / "summaries"
    args = ["--peers", str(peers), "--task", TASK, "--data-workers", "0", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            "--target-batch-size", str(target_batch_size(peers)), "--max-epochs", str(max_epochs),
            "--checkpoint-dir", str(ckpt), "--summary-dir", str(summaries), *peer_args]
    pss: List[float] = []
    async with Swarm(work) as harness:
        launched = time.time()
        swarm = harness.run("swarm", *args, name="swarm")
        deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
        while swarm.process.poll() is None and time.monotonic() < deadline:
            if not pss and min(last_epochs(ckpt, peers)) >= 1:  # every peer trains: read each one's memory once
                parent_kib = common.process_memory_kib(swarm.process.pid).get("Pss") or 0
                roots = psutil.Process(swarm.process.pid).children()
                pss = [round(value + parent_kib / 1024 / len(roots), 1)
                       for value in map(peer_tree_pss_mib, (root.pid for root in roots)) if value is not None]
                if pss:
                    log(f"{peers} peers: {median(pss):.0f} MiB PSS per peer (median of {len(pss)})")
            await asyncio.sleep(2.0)
        exit_code = await swarm.exit_code(timeout=max(1.0, deadline - time.monotonic()))
        output = swarm.log()
    return {"launched": launched, "exit_code": exit_code, "output": output, "pss": pss}


def median_and_max(values: List[float]) -> dict:
    return {"median": common.rounded(median(values), 1) if values else None,
            "max": common.rounded(max(values), 1) if values else None}


def state_digest(state: Dict) -> str:
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def read_run(work: Path, peers: int, max_epochs: int, swarm: dict) -> dict:
    from peer.telemetry.events import EpochEnded, Joined, Ready, RoundEnded, StateDownloaded, read_events
    from peer.testing import load_model_state, max_parameter_difference

    ckpt, summaries = work / "ckpt", work / "summaries"
    rounds: Counter = Counter()
    groups: List[frozenset] = []
    readies, joins, last_join, last_epoch_end, downloads, exit_reasons = [], [], 0.0, 0.0, 0, []
    for index in range(peers):
        events, _ = read_events(ckpt / f"peer-{index}.events.jsonl")
        readies += [event.time - swarm["launched"] for event in events if isinstance(event, Ready)][:1]
        joined = next((event for event in events if isinstance(event, Joined)), None)
        if joined is not None:
            joins.append(joined.time - swarm["launched"])
            last_join = max(last_join, joined.time)
        ends = [event for event in events if isinstance(event, EpochEnded)]
        if ends:
            last_epoch_end = max(last_epoch_end, ends[-1].time)
        rounds.update(event.outcome for event in events if isinstance(event, RoundEnded))
        groups += [frozenset(event.group) for event in events if isinstance(event, RoundEnded) and event.group]
        downloads += sum(isinstance(event, StateDownloaded) for event in events)
        summary = summaries / f"peer-{index}.json"
        exit_reasons.append(json.loads(summary.read_text()).get("exit_reason") if summary.exists() else None)
    finals = {}
    for index in range(peers):
        try:
            finals[index] = load_model_state(ckpt / f"peer-{index}")
        except FileNotFoundError:  # it failed before its first checkpoint: the row says so
            pass
    difference = None
    if 0 in finals:
        difference = max(max_parameter_difference(finals[0], state) for state in finals.values())
    distinct = len({state_digest(state) for state in finals.values()})
    minutes = (last_epoch_end - last_join) / 60 if last_join and last_epoch_end > last_join else None
    output = swarm["output"]
    return {
        "peers": peers, "target_batch_size": target_batch_size(peers), "exit_code": swarm["exit_code"],
        "exit_reasons": exit_reasons,
        "ready_seconds": median_and_max(readies), "join_seconds": median_and_max(joins),
        "epochs_per_minute": common.rounded(max_epochs / minutes, 2) if minutes else None,
        "rounds": dict(rounds), "state_downloads": downloads,
        "group_sizes": {str(size): count for size, count in sorted(Counter(map(len, groups)).items())},
        "distinct_groups": len(set(groups)),
        "max_parameter_difference": difference, "states": distinct,
        "without_checkpoint": [f"peer-{index}" for index in range(peers) if index not in finals],
        "pss_mib_per_peer": common.rounded(median(swarm["pss"]), 1) if swarm["pss"] else None,
        "download_reasons": dict(Counter(re.sub(r"\d+(\.\d+)?", "N", PEER_ID.sub("PEER", line))
                                         for line in DOWNLOAD_LINE.findall(output))),
        "clock_warnings": len(CLOCK_WARNING.findall(output)), "asyncio_errors": output.count(ASYNCIO_ERROR),
        "output_tail": output[-4000:] if swarm["exit_code"] != 0 else "",
    }


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--peers", default=None, help="swarm sizes, comma-separated (default 4,8,12,16; quick 4,8; "
                                                 "smoke 2)")
    p.add_argument("--max-epochs", type=int, default=None, help="epochs of each run (default 8; quick 6; smoke 2)")
    p.add_argument("--logs", type=Path, default=None, help="write each swarm's whole output to DIR/<N>-peers.log, "
                                                           "and keep its peers' directories in DIR/<N>-peers/")
    p.add_argument("--peer-args", default="", help="more `peer swarm` flags for every swarm, as one string, e.g. "
                                                   "\"--averaging local-sgd --target-group-size 4\"")
    args = p.parse_args(argv)
    run = common.Run(NAME, args.mode, args.output)
    sizes = [int(size) for size in (args.peers or common.by_mode(args.mode, smoke="2", quick="4,8",
                                                                  full="4,8,12,16")).split(",")]
    max_epochs = args.max_epochs or common.by_mode(args.mode, smoke=2, quick=6, full=8)
    peer_args = shlex.split(args.peer_args)
    rows = []
    for peers in sizes:
        with tempfile.TemporaryDirectory(prefix="swarmtrain-size-") as work:
            started = time.monotonic()
            swarm = asyncio.run(run_swarm(Path(work), peers, max_epochs, peer_args, run.log))
            row = {**read_run(Path(work), peers, max_epochs, swarm),
                   "wall_seconds": round(time.monotonic() - started, 1)}
            if args.logs is not None:  # its output, and the peers' events, logs and checkpoints it is read from
                shutil.copytree(work, args.logs / f"{peers}-peers", dirs_exist_ok=True)
                (args.logs / f"{peers}-peers.log").write_text(swarm["output"])
        rows.append(row)
        if row["exit_code"] != 0:
            run.note(f"{peers} peers: peer swarm exited {row['exit_code']}; its last output is in the row")
        run.log(f"{peers} peers: exit {row['exit_code']}, {row['states']} final state(s), max difference "
                f"{row['max_parameter_difference']}, rounds {row['rounds']}, {row['state_downloads']} downloads, "
                f"ready {row['ready_seconds']['max']} s, join {row['join_seconds']['max']} s, "
                f"{row['epochs_per_minute']} epochs/min, "
                f"{row['clock_warnings']} clock warnings, {row['asyncio_errors']} asyncio errors")
    results = {"task": TASK, "max_epochs": max_epochs, "peer_args": peer_args, "runs": rows}
    line = "; ".join(f"{row['peers']} peers: {row['states']} state(s), max diff {row['max_parameter_difference']}, "
                     f"{row['epochs_per_minute']} epochs/min, {row['pss_mib_per_peer']} MiB/peer" for row in rows)
    run.finish(results, f"{NAME}: {line}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
