"""An asyncio harness for testing swarms: real `peer start` processes, awaited through their events.

For a researcher checking that a task trains in a swarm and survives a kill, an operator checking a
config change, and this project's own integration tests::

    from peer.testing import Swarm

    async def test_my_task_trains_in_a_swarm(tmp_path):
        async with Swarm(tmp_path, "--task", "my_tasks:make_task", "--target-batch-size", "64") as swarm:
            first, second = await swarm.start(2, "--max-epochs", "5")
            await swarm.all_reached(epoch=5, timeout=300)
            assert await first.exit_code(timeout=120) == 0

Every peer runs in its own session (so that a kill reaches its DHT, p2pd and averager processes),
writes its events to <workdir>/<name>.events.jsonl (peer/telemetry/events.py), its output to
<workdir>/<name>.log and its checkpoints to <workdir>/<name>/. State is learned only from events;
the log is for failure messages. Every wait has a timeout and says what it waited for; a peer that
exits while awaited fails the wait at once, with the tail of its log. Leaving the `async with`, on
any path, kills every process still running and checks that nothing of theirs survived.
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

import psutil

from peer.process.fork_server import ForkServer
from peer.process.launcher import EVENT_WRITERS, KILL_WAIT_SECONDS, POLL_SECONDS, Peer, PeerFailed
from peer.testing.faults import FaultPlan

if TYPE_CHECKING:  # torch is imported where a checkpoint is read: `peer swarm` runs without it
    import torch

FAST_ARGS = (
    "--matchmaking-seconds", "1",
    # a quarter of it per chunk, for peers slowed by a loaded machine: fewer parts arrive too late, which makes rounds
    # partial and sends the peers that missed a part to download a whole peer's state (averaging/strategies/rounds.py)
    "--averaging-timeout-seconds", "20",
    "--data-workers", "1",
    "--val-batches", "4",
)
"""Short rounds and light data loading, for swarms of small models on one machine (opt in with fast=True)."""
FAST_ENV = {"OMP_NUM_THREADS": "1"}
"""With fast=True, one torch thread per peer: several peers share the machine, and torch's default of a thread per
core oversubscribes it (six swarm tests on 2 cores took 153 s instead of 172 s)."""
NEW_PROGRAM_COMMANDS = ("swarm",)  # it sets torch's threads for its peers before it imports torch
_fork_server: Optional[ForkServer] = None  # fork_peers_from()


class Swarm:
    """Peers on this machine (127.0.0.1), or in given network namespaces, torn down on every path.

    `args` go to every peer; per-peer args come after them (for a flag given twice, the last wins).
    The harness adds the rest: a checkpoint directory, an events file and a summary per peer, a free
    metrics port (unless --metrics-port is given), listening on 127.0.0.1 (unless --host-maddrs is
    given), and --initial-peers of the swarm's first node (a peer, or a `bootstrap()` node) for every
    later one, with the --run-owner it names (as the join command the run's first peer prints does).
    `run()` starts any other `peer` command (a monitor, `peer swarm`) as part of the swarm.
    """

    def __init__(self, workdir: Path, *args: str, fast: bool = False, env: Optional[Dict[str, str]] = None):
        self.workdir = Path(workdir)
        self.args = [*(FAST_ARGS if fast else ()), *args]
        self.env = {**(FAST_ENV if fast else {}), **(env or {})}
        self.peers: List[Peer] = []

    async def __aenter__(self) -> "Swarm":
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def peer(self, index: int) -> Peer:
        return self.peers[index]

    @property
    def training_peers(self) -> List[Peer]:
        return [peer for peer in self.peers if peer.command == "start"]

    def run(self, command: str, *args: str, name: str, env: Optional[Dict[str, str]] = None,
            prefix: Sequence[str] = ()) -> Peer:
        """Start any `peer` command (`bootstrap`, `monitor`, `swarm`...) with `args` alone, torn down with the
        swarm; `start` and `bootstrap` write events."""
        forked = _fork_server is not None and command not in NEW_PROGRAM_COMMANDS and not prefix
        peer = Peer(name, command, args, self.workdir, {**self.env, **(env or {})}, prefix,
                    events=command in EVENT_WRITERS, fork_server=_fork_server if forked else None)
        self.peers.append(peer.start())
        return peer

    async def bootstrap(self, *args: str, name: str = "bootstrap", timeout: float = 90.0) -> Peer:
        """Start a `peer bootstrap` node on 127.0.0.1 and await it; peers added later join through it."""
        node = self.run("bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *args, name=name)
        await node.ready(timeout)
        return node

    async def add(self, *args: str, name: Optional[str] = None, join: bool = True, ready: bool = True,
                  env: Optional[Dict[str, str]] = None, namespace: Optional[str] = None, prefix: Sequence[str] = (),
                  timeout: float = 90.0) -> Peer:
        """Start one `peer start`; by default it joins the swarm's first node and is awaited until ready.

        :param namespace: run it in this network namespace (`ip netns exec`); it then listens on all addresses
        :param prefix: what it runs under, such as `taskset -c 0`
        """
        name = name or f"peer-{len(self.peers)}"
        extra = ["--checkpoint-dir", str(self.workdir / name), "--summary-json", str(self.workdir / f"{name}.json")]
        given = [*self.args, *args]
        if "--metrics-port" not in given:
            extra += ["--metrics-port", "0"]
        if "--host-maddrs" not in given and namespace is None:
            extra += ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
        entry = next((peer for peer in self.peers if peer.command in EVENT_WRITERS), None)
        if join and entry is not None:
            extra += ["--initial-peers", entry.address]
            if entry.run_owner is not None and "--run-owner" not in given:  # as the join command the owner printed
                extra += ["--run-owner", entry.run_owner]
        if namespace is not None:
            prefix = ["ip", "netns", "exec", namespace, *prefix]
        peer = self.run("start", *self.args, *extra, *args, name=name, env=env, prefix=prefix)
        if ready:
            await peer.ready(timeout)
        return peer

    async def start(self, count: int, *args: str, timeout: float = 90.0) -> List[Peer]:
        """Start `count` peers: the first, then the others together, once it is ready."""
        first = await self.add(*args, timeout=timeout)
        others = [await self.add(*args, ready=False) for _ in range(count - 1)]
        await asyncio.gather(*(peer.ready(timeout) for peer in others))
        return [first, *others]

    async def all_reached(self, epoch: int, timeout: float, peers: Optional[Sequence[Peer]] = None) -> None:
        """Wait until every training peer (or those given) is at `epoch` or later."""
        await asyncio.gather(*(peer.reach(epoch, timeout) for peer in (peers or self.training_peers)))

    async def all_exited(self, timeout: float, peers: Optional[Sequence[Peer]] = None) -> List[int]:
        """Wait until every training peer (or those given) has exited; their exit codes. A peer that did not in
        time fails it, saying where each peer was (a straggler's log alone does not say how far ahead the others
        were, or whether they had left)."""
        peers = list(peers or self.training_peers)
        try:
            return list(await asyncio.gather(*(peer.exit_code(timeout) for peer in peers)))
        except PeerFailed as e:
            raise PeerFailed(f"{where_each_is(peers)}\n{e}") from e

    def ends_on_request(self, plan: Optional[FaultPlan] = None) -> List[str]:
        """Arguments for a peer whose run end_soon() can end (through the test-only --inject-faults, with the
        faults of `plan` if given): a test sized for the worst load (--max-epochs) ends once its checks are done."""
        plan = (plan or FaultPlan()).model_copy(update={"end_at_epoch_file": str(self._end_file)})
        return ["--inject-faults", plan.model_dump_json()]

    def end_soon(self, peers: Sequence[Peer], margin_epochs: int = 2) -> int:
        """End the run of `peers` (started with ends_on_request()) `margin_epochs` after the furthest of them:
        each reads it on its next step, long before it gets there, so all leave at that epoch, as with
        --max-epochs. Returns that epoch."""
        epoch = max(peer.epoch for peer in peers) + margin_epochs
        written = self._end_file.with_suffix(".tmp")
        written.write_text(str(epoch))
        os.replace(written, self._end_file)  # a peer reads all of it or nothing
        return epoch

    @property
    def _end_file(self) -> Path:
        return self.workdir / "end-at-epoch"

    async def close(self) -> None:
        """Kill whatever is still running, reap it, and check that nothing of any peer survived."""
        for peer in self.peers:
            peer.kill()  # a paused (SIGSTOPped) process dies of SIGKILL too
        deadline = time.monotonic() + KILL_WAIT_SECONDS
        survivors: List[psutil.Process] = []
        while time.monotonic() < deadline:
            for peer in self.peers:
                if peer.process is not None:
                    peer._poll()
            survivors = [proc for peer in self.peers for proc in peer.session_processes()]
            if not survivors:
                return
            for proc in survivors:
                try:
                    proc.kill()
                except psutil.Error:
                    pass
            await asyncio.sleep(POLL_SECONDS)
        raise PeerFailed(f"processes of the swarm survived SIGKILL: {[proc.pid for proc in survivors]}")


def fork_peers_from(server: Optional[ForkServer]) -> None:
    """From now on, start the harness's processes as children of `server` (peer/process/fork_server.py), which has
    imported torch and hivemind once, instead of as new programs that each import them (about 5 CPU seconds a
    peer): the tests do (tests/conftest.py); a benchmark that measures a volunteer's peer must not. Not `peer
    swarm`, nor a process under a prefix. None: new programs again."""
    global _fork_server
    _fork_server = server


def max_parameter_difference(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two peers' model tensors."""
    if a.keys() != b.keys():
        raise ValueError(f"different tensors: {sorted(a.keys() ^ b.keys())[:5]}")
    return max(float((a[key].float() - b[key].float()).abs().max()) for key in a)


def where_each_is(peers: Sequence[Peer]) -> str:
    """One line: each peer's newest epoch, and its exit code or that it still runs."""
    def state(peer: Peer) -> str:
        if peer.process is None:
            return "not started"
        code = peer._poll()
        return "running" if code is None else f"exited {code}"

    return "; ".join(f"{peer.name} at epoch {peer.epoch}, {state(peer)}" for peer in peers)
