"""What a peer costs the machine it runs on, process by process: memory (PSS) and CPU, training and paused.

Two real `peer start` processes of bytelm-tiny train on 127.0.0.1 with the daemon's default settings (but for the
target batch and the task, as `peer swarm --task bytelm-tiny` starts them; `--peer-args` adds flags). Once both
have trained ``--warm-epochs`` epochs, every process of each peer's session is read twice, over a ``--window`` of
seconds each: while it trains, and while it is paused (`peer pause`: what a volunteer's machine pays for a peer
that waits).

Memory is PSS (proportional set size, /proc/<pid>/smaps_rollup): a page shared by k processes counts
1/k in each, so the sum over a peer's processes is what the peer costs. The sum of RSS counts every page that
forked processes share (torch's libraries, the model) once per process, and overstates it several times.

Each process is named by its place in the session: ``training`` (the `peer start` process), ``p2pd`` (libp2p's
daemon), ``dht`` (the process that started p2pd), ``shm_manager`` (torch's shared-memory manager, which hivemind's
file_system sharing starts: a peer shares by descriptor unless HIVEMIND_MEMORY_SHARING_STRATEGY says otherwise),
``averager`` (hivemind's averagers run in processes of their own, each with an event loop and a dozen threads) and
``data_worker`` (a DataLoader worker: the other children, with a few threads; their count is checked against
--data-workers).

Usage (from the repository root)::

    python -m benchmarks.peer_memory            # 20 s windows
    python -m benchmarks.peer_memory --quick    # 10 s windows
    python -m benchmarks.peer_memory --smoke    # 3 s windows; checks that the script works
    python -m benchmarks.peer_memory --peer-args "--data-workers 0"

JSON ``results``: ``peer_args``; ``peers``: per peer, ``processes`` (one row per process: ``role``, ``pid``,
``pss_mib``, ``uss_mib``, ``rss_mib``, ``threads``, ``cpu_training`` and ``cpu_paused`` in CPU seconds per
second), ``by_role`` (the same, summed per role), ``pss_mib`` and ``rss_mib`` (the peer's totals) and
``cpu_training`` / ``cpu_paused`` (its totals); ``pss_mib_per_peer`` (the mean over peers).
"""
from __future__ import annotations

import asyncio
import os
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common  # noqa: E402 (after the path fix above)
from benchmarks.pause import peer_command  # noqa: E402

NAME = "peer_memory"
TASK_ARGS = ("--task", "bytelm-tiny", "--target-batch-size", "256")
AVERAGER_MIN_THREADS = 6


def session_processes(root_pid: int) -> Dict[int, str]:
    """Every live process of a peer, by pid, with its role (see the module's docstring)."""
    import psutil

    root = psutil.Process(root_pid)
    children = root.children(recursive=True)
    roles = {root_pid: "training"}
    for child in children:
        if "p2pd" in child.name():
            roles[child.pid] = "p2pd"
            roles[child.ppid()] = "dht"
        elif "torch_shm" in child.name():
            roles[child.pid] = "shm_manager"
    for child in children:
        if child.pid not in roles:
            # an averager runs an event loop, a libp2p client and executor threads; a DataLoader worker reads and
            # collates on its main thread and a watchdog or two
            roles[child.pid] = "averager" if child.num_threads() >= AVERAGER_MIN_THREADS else "data_worker"
    return roles


def memory(pid: int) -> Optional[dict]:
    import psutil

    kib = common.process_memory_kib(pid)
    try:
        threads = psutil.Process(pid).num_threads()
    except psutil.Error:
        return None
    return {"pss_mib": round(kib["Pss"] / 1024, 1), "uss_mib": round(kib["Uss"] / 1024, 1),
            "rss_mib": round(kib["Rss"] / 1024, 1), "threads": threads}


def cpu_rates(pids: List[int], seconds: float) -> Dict[int, float]:
    """CPU seconds per second of each process over the next `seconds`."""
    before = {pid: common.process_cpu_seconds(pid) for pid in pids}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    rates = {}
    for pid in pids:
        after = common.process_cpu_seconds(pid)
        if before[pid] is not None and after is not None:
            rates[pid] = round((after - before[pid]) / elapsed, 3)
    return rates


def peer_report(roles: Dict[int, str], training: Dict[int, float], paused: Dict[int, float]) -> dict:
    rows = []
    for pid, role in sorted(roles.items(), key=lambda item: item[1]):
        reading = memory(pid)
        if reading is None:
            continue
        rows.append({"role": role, "pid": pid, **reading, "cpu_training": training.get(pid),
                     "cpu_paused": paused.get(pid)})
    by_role: Dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        totals = by_role[row["role"]]
        totals["processes"] += 1
        for field in ("pss_mib", "uss_mib", "rss_mib", "cpu_training", "cpu_paused"):
            totals[field] = round(totals[field] + (row[field] or 0.0), 3)
    return {"processes": rows,
            "by_role": {role: {**totals, "processes": int(totals["processes"])} for role, totals in by_role.items()},
            "pss_mib": round(sum(row["pss_mib"] for row in rows), 1),
            "rss_mib": round(sum(row["rss_mib"] for row in rows), 1),
            "cpu_training": round(sum(row["cpu_training"] or 0.0 for row in rows), 3),
            "cpu_paused": round(sum(row["cpu_paused"] or 0.0 for row in rows), 3)}


async def measure(work: Path, peer_args: List[str], warm_epochs: int, window: float, log) -> List[dict]:
    from peer.telemetry.events import Paused
    from peer.testing import Swarm

    async with Swarm(work, *TASK_ARGS, *peer_args) as swarm:
        peers = await swarm.start(2, "--min-peers", "2", timeout=180)
        await swarm.all_reached(warm_epochs, timeout=600)
        roles = {peer.name: session_processes(peer.process.pid) for peer in peers}
        every_pid = [pid for by_pid in roles.values() for pid in by_pid]
        training = await asyncio.to_thread(cpu_rates, every_pid, window)
        log(f"training: {sum(training.values()):.2f} CPU seconds per second over both peers")
        for peer in peers:
            done = await peer_command(work, "pause", "--checkpoint-dir", str(work / peer.name))
            if done.returncode != 0:
                raise RuntimeError(f"peer pause failed: {done.stdout}{done.stderr}")
            await peer.wait_for(Paused, timeout=60, what="the pause")
        paused = await asyncio.to_thread(cpu_rates, every_pid, window)
        reports = [{"name": peer.name, **peer_report(roles[peer.name], training, paused)} for peer in peers]
        swarm.end_soon(peers)
        return reports


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--peer-args", default="", help="more `peer start` flags for both peers (one shell-quoted string)")
    p.add_argument("--warm-epochs", type=int, default=None, help="epochs both peers train before the readings "
                                                                 "(default 3; smoke 1)")
    p.add_argument("--window", type=float, default=None, help="seconds of each CPU reading (default 20; quick 10; "
                                                              "smoke 3)")
    args = p.parse_args(argv)
    run = common.Run(NAME, args.mode, args.output)
    peer_args = shlex.split(args.peer_args)
    warm = args.warm_epochs or common.by_mode(args.mode, smoke=1, quick=3, full=3)
    window = args.window or common.by_mode(args.mode, smoke=3.0, quick=10.0, full=20.0)
    with tempfile.TemporaryDirectory(prefix="swarmtrain-memory-") as work:
        peers = asyncio.run(measure(Path(work), peer_args, warm, window, run.log))
    per_peer = round(sum(peer["pss_mib"] for peer in peers) / len(peers), 1)
    workers = int(peer_args[peer_args.index("--data-workers") + 1]) if "--data-workers" in peer_args else 2
    for peer in peers:
        found = peer["by_role"].get("data_worker", {}).get("processes", 0)
        if found != workers:
            run.note(f"{peer['name']}: {found:g} processes named data_worker, but --data-workers is {workers}: "
                     f"the roles by thread count are off")
    results = {"task": TASK_ARGS[1], "peer_args": peer_args, "warm_epochs": warm, "window_seconds": window,
               "peers": peers, "pss_mib_per_peer": per_peer}
    roles = ", ".join(f"{role} {totals['pss_mib']:.0f}" for role, totals in sorted(peers[0]["by_role"].items()))
    run.finish(results, f"{NAME}: {per_peer:.0f} MiB PSS per peer (the first: {roles}); CPU paused "
                        f"{peers[0]['cpu_paused']:.2f} s/s, training {peers[0]['cpu_training']:.2f} s/s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
