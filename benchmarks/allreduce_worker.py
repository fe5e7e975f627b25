"""One averaging peer for benchmarks/allreduce_link.py, driven over stdin/stdout; not run by hand.

Started as `[ip netns exec NS] python -m benchmarks.allreduce_worker --host-ip IP ...`. It starts
a DHT, builds two averagers over the same payload size, and then runs the rounds the
coordinator asks for, one JSON command per stdin line. Replies are stdout lines that start
with ``@@ `` followed by JSON (anything else on stdout is ignored); logs go to stderr.

- ``bare``: `hivemind.averaging.DecentralizedAverager` over one float32 tensor, hivemind's
  defaults except ``min_matchmaking_time`` (the same window as ours).
- ``ours``: the gradient averager of the SyncOptimizer that `averaging.strategies.factory.build_swarm_optimizer`
  builds from an `AveragingConfig` (our codec, request timeout, matchmaking floor, all-reduce
  timeout), over a model with one parameter of the same size, driven as hivemind.Optimizer
  drives it: ``schedule_step`` (matchmaking ahead of time), then ``step(control=...)``.

A round is split at the moment the group is assembled (the StepControl reaches
AWAITING_TRIGGER): ``matchmaking_seconds`` before, ``allreduce_seconds`` after. Commands:
``{"cmd": "round", "config": "bare"|"ours", "scheduled_time": T, "timeout": S}``,
``{"cmd": "listen"}`` / ``{"cmd": "send", "host": ..., "port": ..., "bytes": ...}`` (raw TCP
throughput of the link), ``{"cmd": "quit"}``. Exits when stdin closes.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

POLL_SECONDS = 0.001


def reply(**message) -> None:
    sys.stdout.write("@@ " + json.dumps(message) + "\n")
    sys.stdout.flush()


def describe_averager(averager) -> dict:
    """The settings an averager was built with, as its own attributes say (readable from this process)."""
    mm, ar = averager.matchmaking_kwargs, averager.allreduce_kwargs
    return {
        "class": type(averager).__name__,
        "min_matchmaking_time": mm["min_matchmaking_time"],
        "request_timeout": mm["request_timeout"],
        "target_group_size": mm["target_group_size"],
        "min_group_size": mm["min_group_size"],
        "compression": type(ar["compression"]).__name__,
        "part_size_bytes": ar["part_size_bytes"],
        "allreduce_timeout": averager._allreduce_timeout,
        "next_chunk_timeout": averager.next_chunk_timeout,
    }


def wait_for_group(control, deadline: float) -> None:
    """Block until the round's group is assembled (or the round ended, e.g. failed)."""
    from hivemind.averaging.control import AveragingStage

    while time.monotonic() < deadline and not control.done():
        if control.stage in (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE):
            return
        time.sleep(POLL_SECONDS)


class Peer:
    def __init__(self, args):
        import hivemind
        import torch

        from averaging.api import Replica
        from averaging.config import AveragingConfig
        from averaging.strategies.factory import build_swarm_optimizer
        from dht.config import DHTConfig
        from dht.keys import SwarmKeys
        from dht.node import start_dht

        numel = int(args.size_mib * 2**20) // 4
        self.dht = start_dht(DHTConfig(
            host_maddrs=[f"/ip4/{args.host_ip}/tcp/0"],
            initial_peers=[args.initial_peer] if args.initial_peer else [],
            startup_timeout_seconds=60.0,
        ))
        reply(event="ready", maddrs=[str(m) for m in self.dht.get_visible_maddrs()])

        generator = torch.Generator().manual_seed(args.seed)
        self.bare = hivemind.averaging.DecentralizedAverager(
            [torch.randn(numel, generator=generator)], self.dht, prefix=f"{args.run_id}_bare",
            min_matchmaking_time=args.matchmaking_seconds, start=True,
        )
        self.param = torch.nn.Parameter(torch.zeros(numel))
        self.config = AveragingConfig(
            target_batch_size=10**9, matchmaking_seconds=args.matchmaking_seconds,
            averaging_timeout_seconds=args.averaging_timeout_seconds, grad_compression=args.grad_compression,
        )
        self.optimizer = build_swarm_optimizer(self.config, Replica(
            dht=self.dht, keys=SwarmKeys.for_run(f"{args.run_id}_ours"), params=[self.param],
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0), client_mode=False,
        ))
        self.ours = self.optimizer.grad_averager
        self.param.grad = torch.randn(numel, generator=generator)
        reply(event="built", bare=describe_averager(self.bare), ours=describe_averager(self.ours),
              ours_config=self.config.model_dump(mode="json"))
        self._listener = None

    def round(self, config: str, scheduled_time: float, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        started = time.time()
        try:
            if config == "bare":
                control = self.bare.step(scheduled_time=scheduled_time, timeout=timeout, wait=False,
                                         require_trigger=True)
                wait_for_group(control, deadline)
                grouped = time.time()
                control.allow_allreduce()
                gathered = control.result(max(0.1, deadline - time.monotonic()))
            else:
                self.ours.accumulate_grads_(batch_size=1)
                control = self.ours.schedule_step(scheduled_time=scheduled_time, timeout=timeout)
                wait_for_group(control, deadline)
                grouped = time.time()
                gathered = self.ours.step(control=control, timeout=max(0.1, deadline - time.monotonic()))
                with self.ours.use_averaged_gradients():
                    pass  # what the optimizer does next; clears hivemind's "results not used" flag
            done = time.time()
            return dict(ok=gathered is not None, group_size=len(gathered or {}), t_call=started, t_group=grouped,
                        t_done=done, matchmaking_seconds=grouped - started, allreduce_seconds=done - grouped)
        except BaseException as e:  # a failed round is a result, not a crash
            if config == "ours":
                self.ours.reset_accumulated_grads_()
            return dict(ok=False, error=f"{type(e).__name__}: {e}"[:300], t_call=started, t_done=time.time())

    # --- raw TCP throughput of the link, for comparison with the nominal rate -------------------

    def listen(self) -> dict:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind(("0.0.0.0", 0))
        server.listen(1)
        server.settimeout(60)

        def drain():
            try:
                connection, _ = server.accept()
                with connection:
                    while connection.recv(1 << 20):
                        pass
            except OSError:
                pass
            finally:
                server.close()

        self._listener = threading.Thread(target=drain, daemon=True)
        self._listener.start()
        return dict(port=server.getsockname()[1])

    @staticmethod
    def send(host: str, port: int, nbytes: int) -> dict:
        chunk = b"\0" * (1 << 20)
        with socket.create_connection((host, port), timeout=60) as connection:
            started = time.perf_counter()
            left = nbytes
            while left > 0:
                connection.sendall(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
            connection.shutdown(socket.SHUT_WR)
            connection.recv(1)  # returns when the receiver has read everything and closed
            seconds = time.perf_counter() - started
        return dict(seconds=seconds, bytes=nbytes, mbit_per_second=nbytes * 8 / seconds / 1e6)

    def close(self) -> None:
        from dht.node import shutdown_dht

        for closer in (self.optimizer.shutdown, self.bare.shutdown):
            try:
                closer()
            except Exception:
                pass
        shutdown_dht(self.dht)


def main() -> int:
    p = argparse.ArgumentParser(description="one peer of benchmarks/allreduce_link.py")
    p.add_argument("--host-ip", required=True)
    p.add_argument("--initial-peer", default=None)
    p.add_argument("--size-mib", type=float, required=True)
    p.add_argument("--matchmaking-seconds", type=float, required=True)
    p.add_argument("--averaging-timeout-seconds", type=float, required=True)
    p.add_argument("--grad-compression", default="none")
    p.add_argument("--run-id", default="bench")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from peer.process import lifeline
    from peer.telemetry.logs import silence_hivemind

    lifeline.install()  # the DHT, p2pd and averager processes die with this worker
    peer = Peer(args)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            name = command.pop("cmd")
            if name == "quit":
                break
            if name == "round":
                reply(event="round", **peer.round(**command))
            elif name == "listen":
                reply(event="listen", **peer.listen())
            elif name == "send":
                reply(event="send", **peer.send(command["host"], command["port"], command["bytes"]))
    finally:
        silence_hivemind()
        peer.close()
        reply(event="closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
