"""All-reduce over rate-limited links: round time against the link's lower bound, hivemind's bare averager vs ours.

N peers each run in their own network namespace behind one bridge, every peer's egress
limited with `tc tbf` (e.g. 100 Mbit/s, 1 Gbit/s); each averages S MiB of float32. Two
averaging paths run in the same processes, round after round, interleaved (bare, ours, ours,
bare, ...; links interleaved too, by re-shaping the same namespaces between rounds):

- ``bare``: `hivemind.averaging.DecentralizedAverager`, hivemind's defaults (no compression,
  request_timeout 3 s, no all-reduce timeout) except the matchmaking window, which both share;
- ``ours``: the gradient averager that `build_swarm_optimizer` builds for `peer start` from an
  `AveragingConfig` (``--grad-compression``, default none; request_timeout = min(3, window/2);
  all-reduce timeout = ``--averaging-timeout-seconds``), driven as hivemind.Optimizer drives it:
  matchmaking scheduled ahead, then the accumulated gradients are loaded and the round triggered.
  The JSON's ``ours`` and ``bare`` objects list the settings read back from the averagers.

Every round, the coordinator gives all peers the same scheduled start (now + window). Each
peer splits its round where its group is assembled: ``matchmaking`` (from its call until the
group exists; mostly the scheduled window) and ``allreduce`` (from then until it holds the
average). Per round: allreduce = slowest peer's all-reduce; round = slowest peer's whole
round. The lower bound of a butterfly all-reduce, where each peer sends 2(N-1)/N of the payload
through its own egress, is ``2(N-1)/N * S / B``. A raw TCP transfer between two peers
measures what the shaped link really carries (``tcp_mbit``). The same rounds also run on
127.0.0.1 with no rate limit (``link: loopback``), where no bound applies.

Without root (or without iproute2), the namespaced rows are skipped and only loopback runs;
the JSON says so (``network``) and so does the output.

Usage (from the repository root, as root for namespaces)::

    python -m benchmarks.allreduce_link --quick   # N 2,4; 16 MiB; 100mbit, 1gbit, loopback
    python -m benchmarks.allreduce_link           # N 2,4,8; 64 and 256 MiB (needs ~1.5 GiB RAM per peer at 256)
    python -m benchmarks.allreduce_link --smoke   # N 2; 1 MiB; one shaped link; for tests

JSON ``results``:

- ``network``: ``netns`` or ``loopback-only`` (with ``network_note``); ``settings`` (peers, sizes_mib,
  links, rounds, warmup_rounds, matchmaking_seconds, averaging_timeout_seconds, grad_compression);
- ``bare`` / ``ours``: ``{"description", "averager"}``, the averager settings read back from each;
- ``rows``: one per (peers, size_mib, link, config): ``rounds_ok``, ``rounds_failed``, ``errors``,
  ``group_sizes``, ``round_seconds``, ``matchmaking_seconds``, ``matchmaking_past_schedule_seconds``,
  ``allreduce_seconds`` (each ``{median, min, max, n}``), ``bound_seconds`` (null on loopback),
  ``allreduce_over_bound``, ``round_over_bound`` (medians over the bound), ``tcp_mbit``;
- ``ratios``: one per (peers, size_mib, link): ``ours_over_bare_allreduce`` and
  ``ours_over_bare_round`` (``{median, min, max, n}`` of per-round ratios).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common, netns

NAME = "allreduce_link"
CONFIGS = ("bare", "ours")
LOOPBACK = "loopback"


class Worker:
    """One `benchmarks.allreduce_worker` process (inside a namespace or not), spoken to line by line."""

    def __init__(self, prefix: List[str], host_ip: str, initial_peer: Optional[str], args, log_dir: Path, index: int):
        self.index = index
        self.log_path = log_dir / f"worker-{index}.log"
        self._log = open(self.log_path, "w")
        cmd = [*prefix, sys.executable, "-m", "benchmarks.allreduce_worker", "--host-ip", host_ip,
               "--size-mib", str(args.size_mib), "--matchmaking-seconds", str(args.matchmaking_seconds),
               "--averaging-timeout-seconds", str(args.averaging_timeout_seconds),
               "--grad-compression", args.grad_compression, "--run-id", args.run_id, "--seed", str(index)]
        if initial_peer:
            cmd += ["--initial-peer", initial_peer]
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                        text=True, bufsize=1, cwd=common.REPO_ROOT, env=common.child_env(),
                                        start_new_session=True)
        self.messages: "queue.Queue[dict]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("@@ "):
                self.messages.put(json.loads(line[3:]))
        self.messages.put({"event": "exited"})

    def send(self, **command) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def expect(self, event: str, timeout: float) -> dict:
        try:
            message = self.messages.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"worker {self.index}: no '{event}' within {timeout:.0f}s; "
                               f"log tail:\n{self.tail()}") from None
        if message.get("event") != event:
            raise RuntimeError(f"worker {self.index}: expected '{event}', got {message}; log tail:\n{self.tail()}")
        return message

    def tail(self, chars: int = 2000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 20.0) -> None:
        """Ask it to quit, wait (bounded), then kill its whole session (DHT, p2pd, averagers)."""
        try:
            if self.process.poll() is None:
                self.send(cmd="quit")
                self.process.stdin.close()
                self.process.wait(timeout)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        common.kill_session(self.process)
        self._log.close()


def pick_maddr(maddrs: List[str], ip: str) -> str:
    for maddr in maddrs:
        if f"/ip4/{ip}/" in maddr:
            return maddr
    return maddrs[0]


def bound_seconds(peers: int, size_mib: float, link: str) -> Optional[float]:
    if link == LOOPBACK:
        return None
    return 2 * (peers - 1) / peers * size_mib * 2**20 * 8 / netns.rate_bits_per_second(link)


def run_session(run: common.Run, peers: int, size_mib: float, links: List[str], use_netns: bool, args,
                log_dir: Path) -> List[dict]:
    """Start N workers (in namespaces, or on 127.0.0.1), run every round, stop them; one record per round."""
    bridge = netns.Bridge(peers) if use_netns else None
    workers: List[Worker] = []
    records: List[dict] = []
    args.size_mib = size_mib
    session_log = log_dir / f"n{peers}-{size_mib:g}mib-{'netns' if use_netns else 'lo'}"
    session_log.mkdir(parents=True, exist_ok=True)
    start_timeout = 120.0
    try:
        if bridge is not None:
            bridge.up()
        ip = (lambda i: bridge.ip(i)) if bridge else (lambda i: "127.0.0.1")
        prefix = (lambda i: bridge.exec_prefix(i)) if bridge else (lambda i: [])
        workers.append(Worker(prefix(0), ip(0), None, args, session_log, 0))
        first = pick_maddr(workers[0].expect("ready", start_timeout)["maddrs"], ip(0))
        workers += [Worker(prefix(i), ip(i), first, args, session_log, i) for i in range(1, peers)]
        for worker in workers[1:]:
            worker.expect("ready", start_timeout)
        built = [worker.expect("built", start_timeout) for worker in workers]
        run.settings_seen = built[0]

        tcp: Dict[str, float] = {}
        for link in links:
            if bridge is not None:
                bridge.set_rate(link)
            # about a second's worth at the nominal rate, so that tbf's initial burst hardly counts
            nbytes = (int(64 * 2**20) if link == LOOPBACK
                      else int(netns.rate_bits_per_second(link) / 8 * args.tcp_seconds))
            workers[1].send(cmd="listen")
            port = workers[1].expect("listen", 30)["port"]
            workers[0].send(cmd="send", host=ip(1), port=port, bytes=nbytes)
            tcp[link] = workers[0].expect("send", 120)["mbit_per_second"]
        run.log(f"N={peers} {size_mib:g} MiB: raw TCP " + ", ".join(f"{k} {v:.0f} Mbit/s" for k, v in tcp.items()))

        total_rounds = args.warmup_rounds + args.rounds
        for r in range(total_rounds):
            for link in common.interleaved(links, r):
                if bridge is not None:
                    bridge.set_rate(link)
                bound = bound_seconds(peers, size_mib, link)
                timeout = args.matchmaking_seconds + 30 + 6 * (bound or size_mib / 50)
                for config in common.interleaved(CONFIGS, r):
                    scheduled = time.time() + args.matchmaking_seconds
                    for worker in workers:
                        worker.send(cmd="round", config=config, scheduled_time=scheduled, timeout=timeout)
                    replies = [worker.expect("round", timeout + 30) for worker in workers]
                    record = summarize_round(replies, scheduled)
                    record.update(peers=peers, size_mib=size_mib, link=link, config=config, round=r,
                                  warmup=r < args.warmup_rounds, tcp_mbit=tcp[link])
                    records.append(record)
                    status = "ok" if record["ok"] else f"FAILED ({record['errors'][:1]})"
                    run.log(f"N={peers} {size_mib:g} MiB {link:>8} {config:>4} round {r}: "
                            f"matchmaking {record.get('matchmaking_seconds', float('nan')):.2f}s "
                            f"all-reduce {record.get('allreduce_seconds', float('nan')):.2f}s "
                            f"(bound {bound or float('nan'):.2f}s) {status}")
    except Exception as e:
        tails = "\n".join(f"--- worker {w.index}:\n{w.tail(1500)}" for w in workers)
        run.note(f"N={peers} {size_mib:g} MiB ({'netns' if use_netns else 'loopback'}) stopped early: "
                 f"{type(e).__name__}: {str(e).splitlines()[0]}")
        run.log(tails)
    finally:
        for worker in workers:
            worker.stop()
        if bridge is not None:
            bridge.down()
    return records


def summarize_round(replies: List[dict], scheduled: float) -> dict:
    errors = [r["error"] for r in replies if not r.get("ok")]
    sizes = [r.get("group_size", 0) for r in replies]
    record = {"ok": not errors and min(sizes) == len(replies), "errors": errors, "group_sizes": sizes}
    if not errors:
        record.update(
            matchmaking_seconds=max(r["matchmaking_seconds"] for r in replies),
            matchmaking_past_schedule_seconds=max(r["t_group"] for r in replies) - scheduled,
            allreduce_seconds=max(r["allreduce_seconds"] for r in replies),
            round_seconds=max(r["t_done"] - r["t_call"] for r in replies),
        )
    return record


def aggregate(records: List[dict]) -> (List[dict], List[dict]):
    rows, ratios = [], []
    keys = sorted({(r["peers"], r["size_mib"], r["link"]) for r in records}, key=lambda k: (k[0], k[1], k[2]))
    for peers, size, link in keys:
        measured = [r for r in records if (r["peers"], r["size_mib"], r["link"]) == (peers, size, link)
                    and not r["warmup"]]
        bound = bound_seconds(peers, size, link)
        per_config = {}
        for config in CONFIGS:
            mine = [r for r in measured if r["config"] == config]
            good = [r for r in mine if r["ok"]]
            row = {
                "peers": peers, "size_mib": size, "link": link, "config": config,
                "rounds_ok": len(good), "rounds_failed": len(mine) - len(good),
                "errors": [e for r in mine for e in r["errors"]][:3],
                "group_sizes": [r["group_sizes"] for r in mine],
                "tcp_mbit": common.rounded(mine[0]["tcp_mbit"], 1) if mine else None,
                "bound_seconds": common.rounded(bound),
            }
            for field in ("round_seconds", "matchmaking_seconds", "matchmaking_past_schedule_seconds",
                          "allreduce_seconds"):
                row[field] = common.stats((r[field] for r in good), 4)
            for field, source in (("allreduce_over_bound", "allreduce_seconds"), ("round_over_bound", "round_seconds")):
                median = row[source]["median"]
                row[field] = common.rounded(median / bound, 3) if bound and median is not None else None
            rows.append(row)
            per_config[config] = {r["round"]: r for r in good}
        both = sorted(set(per_config["bare"]) & set(per_config["ours"]))
        ratios.append({
            "peers": peers, "size_mib": size, "link": link,
            **{f"ours_over_bare_{what}": common.stats(common.paired_ratios(
                [per_config["ours"][i][f"{what}_seconds"] for i in both],
                [per_config["bare"][i][f"{what}_seconds"] for i in both]), 3)
               for what in ("allreduce", "round")},
        })
    return rows, ratios


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--peers", default=None, help="comma-separated group sizes (quick: 2,4; full: 2,4,8)")
    p.add_argument("--sizes-mib", default=None, help="comma-separated payload sizes in MiB (quick: 16; full: 64,256)")
    p.add_argument("--links", default=None, help="comma-separated tc rates (quick/full: 100mbit,1gbit)")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds per (link, config)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and not counted")
    p.add_argument("--matchmaking-seconds", type=float, default=None,
                   help="the matchmaking window both paths use (ours: --matchmaking-seconds; default 1.5)")
    p.add_argument("--averaging-timeout-seconds", type=float, default=60.0,
                   help="ours: --averaging-timeout-seconds (the all-reduce timeout)")
    p.add_argument("--grad-compression", default="none", help="ours: --grad-compression (default none, as peer start)")
    p.add_argument("--no-loopback", action="store_true", help="skip the 127.0.0.1 rows")
    args = p.parse_args(argv)
    mode = args.mode
    peer_counts = [int(x) for x in
                   (args.peers or common.by_mode(mode, smoke="2", quick="2,4", full="2,4,8")).split(",")]
    sizes = [float(x) for x in
             (args.sizes_mib or common.by_mode(mode, smoke="1", quick="16", full="64,256")).split(",")]
    links = (args.links
             or common.by_mode(mode, smoke="100mbit", quick="100mbit,1gbit", full="100mbit,1gbit")).split(",")
    args.rounds = args.rounds or common.by_mode(mode, smoke=1, quick=3, full=5)
    args.warmup_rounds = args.warmup_rounds if mode != "smoke" else 0
    args.matchmaking_seconds = args.matchmaking_seconds or common.by_mode(mode, smoke=1.0, quick=1.5, full=2.0)
    args.run_id = f"bench{os.getpid()}"
    args.tcp_seconds = common.by_mode(mode, smoke=0.25, quick=1.0, full=2.0)
    if mode == "smoke" and netns.unavailable_reason() is None:
        args.no_loopback = True  # one session is enough to check the script
    run = common.Run(NAME, mode, args.output)
    run.settings_seen = None

    # SIGTERM (a timeout, a CI cancel) unwinds through the finally blocks that stop workers and delete namespaces
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    reason = netns.unavailable_reason()
    network = "netns" if reason is None else "loopback-only"
    if reason:
        run.note(reason)
    else:
        stale = netns.remove_stale()
        if stale:
            run.log(f"removed namespaces left by an earlier killed run: {', '.join(stale)}")
    records: List[dict] = []
    with tempfile.TemporaryDirectory(prefix="swarmtrain-allreduce-") as log_dir:
        for peers in peer_counts:
            for size in sizes:
                if reason is None:
                    records += run_session(run, peers, size, links, True, args, Path(log_dir))
                if reason is not None or not args.no_loopback:
                    records += run_session(run, peers, size, [LOOPBACK], False, args, Path(log_dir))
    rows, ratios = aggregate(records)
    seen = run.settings_seen or {}
    results = {
        "network": network,
        "network_note": reason or "each peer in its own namespace on one bridge; egress shaped with tc tbf",
        "settings": {"peers": peer_counts, "sizes_mib": sizes, "links": links if reason is None else [],
                     "loopback": reason is not None or not args.no_loopback, "rounds": args.rounds,
                     "warmup_rounds": args.warmup_rounds, "matchmaking_seconds": args.matchmaking_seconds,
                     "averaging_timeout_seconds": args.averaging_timeout_seconds,
                     "grad_compression": args.grad_compression},
        "bare": {"description": "hivemind.averaging.DecentralizedAverager with hivemind's defaults except "
                                "min_matchmaking_time (shared window); one float32 tensor",
                 "averager": seen.get("bare")},
        "ours": {"description": "the gradient averager of build_swarm_optimizer(AveragingConfig(...)) as peer start "
                                "builds it (codec, request_timeout, matchmaking floor, all-reduce timeout, "
                                "next_chunk_timeout), driven like hivemind.Optimizer: schedule_step, then "
                                "step(control) after loading the accumulated gradients",
                 "averager": seen.get("ours"), "averaging_config": seen.get("ours_config")},
        "rows": rows,
        "ratios": ratios,
    }
    failed = sum(row["rounds_failed"] for row in rows)
    if failed:
        run.note(f"{failed} measured round(s) failed or formed a smaller group; see rows[].errors / group_sizes")
    shaped = [row for row in rows if row["allreduce_over_bound"] is not None]

    def median_over_bound(config: str) -> Optional[float]:
        return common.stats(r["allreduce_over_bound"] for r in shaped if r["config"] == config)["median"]

    headline = [r for r in ratios if r["link"] != LOOPBACK] or ratios
    ours_bare = common.stats(r["ours_over_bare_allreduce"]["median"] for r in headline)["median"]
    line = (f"{NAME} ({network}; N {','.join(map(str, peer_counts))}; {','.join(f'{s:g}' for s in sizes)} MiB): "
            f"all-reduce / link bound, median over shaped rows: bare {common.fmt_ratio(median_over_bound('bare'))}, "
            f"ours {common.fmt_ratio(median_over_bound('ours'))}; ours/bare all-reduce time "
            f"({'shaped' if any(r['link'] != LOOPBACK for r in headline) else 'loopback'} rows) "
            f"{common.fmt_ratio(ours_bare)}; failed rounds {failed}")
    run.finish(results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
