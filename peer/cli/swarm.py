"""`peer swarm`: N peers on this machine, for trying things out and for tests.

Built on the asyncio harness (peer/testing/) that the tests and benchmarks use. Peer 0 starts the
swarm; the others are started once its events file says it is ready, and join it. Each peer is a
`peer start` process in its own session with its own checkpoint subdirectory, metrics port, events
file and summary file; its output is prefixed with its name. On the CPU, the peers are forked from
this process once it has imported torch and hivemind (peer/process/preforked.py), and each gets torch
threads for its share of the cores. With `--gpus`, one peer per GPU, each a new program on its own
(`--device cuda:N`). A signal to this process is passed on to every peer (a second one kills them),
and every peer is told to stop (SIGTERM, via the parent-death signal) if this process dies.
Exits non-zero if any peer failed.
"""
from __future__ import annotations

import asyncio
import functools
import math
import os
import signal
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import click

from peer.config import PeerConfig
from peer.exit_codes import ExitCode
from peer.process import preforked
from peer.process.launcher import Peer, PeerFailed
from peer.process.p2p_daemon_heap import bound_p2p_daemon_heap
from peer.process.preforked import Preforked
from peer.process.tensor_sharing import share_tensors_by_descriptor
from peer.telemetry.events import Ready

BOOTSTRAP_TIMEOUT_SECONDS = 180.0


def threads_per_peer(num_peers: int, cores: int) -> Dict[str, str]:
    """torch's threads for each of `num_peers` peers on `cores` cores, unless the user chose them: a share of the
    cores each, at least one. torch's default is a thread per core in every process, and threads that outnumber
    the cores wait on each other: 16 processes training on 2 cores made 143 steps in 15 s with 2 threads each,
    1618 with one."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    threads = str(max(1, cores // num_peers))
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def prepare_cpu_peers(num_peers: int) -> None:
    """What torch and hivemind read as they are imported, set for the peers this process will fork: torch threads
    for each peer's share of the cores, and tensors shared by descriptor; and the garbage each peer's p2pd keeps. Call
    it before either is imported."""
    if "torch" in sys.modules:
        raise RuntimeError("torch was imported before the peers' threads were set: prepare the peers first")
    os.environ.update(threads_per_peer(num_peers, len(os.sched_getaffinity(0))))
    share_tensors_by_descriptor()
    bound_p2p_daemon_heap()


def local_peer(config: PeerConfig, index: int, args: List[str], children: Sequence[Preforked]) -> Peer:
    name = f"peer-{index}"
    return Peer(name, "start", args, config.checkpoint.checkpoint_dir, output=_prefixed(name),
                events_path=events_path(config, index), die_with_parent=True,
                preforked=children[index] if children else None).start()


def _prefixed(name: str) -> Callable[[str], None]:
    return lambda line: click.echo(f"[{name}] {line}")


def choose_gpus(spec: str, gpu_count: int) -> List[int]:
    """`--gpus all` or `--gpus 0,2` -> the GPU indices, one peer each.

    :raises ValueError: one line naming the value, the rule and a fix
    """
    gpus: Optional[List[int]] = None
    if spec.strip() != "all":
        try:
            gpus = [int(part) for part in spec.split(",")]
        except ValueError:
            raise ValueError(f"--gpus {spec!r}: give 'all' or GPU indices separated by commas, such as 0,1") from None
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"--gpus {spec}: a GPU is listed twice; give each index once")
    if gpu_count == 0:
        raise ValueError(f"--gpus {spec}: this machine has no CUDA device that torch can use; leave out --gpus to "
                         f"run the peers on the CPU")
    if gpus is None:
        return list(range(gpu_count))
    missing = [gpu for gpu in gpus if not 0 <= gpu < gpu_count]
    if missing:
        raise ValueError(f"--gpus {spec}: no GPU {missing[0]}; this machine has GPUs 0 to {gpu_count - 1}")
    return gpus


def events_path(config: PeerConfig, index: int) -> Path:
    """Each peer's events file: <--events>.peer-N when --events is given, else next to its checkpoints."""
    if config.logging.events is not None:
        return Path(f"{config.logging.events}.peer-{index}")
    return config.checkpoint.checkpoint_dir / f"peer-{index}.events.jsonl"


def peer_args(config: PeerConfig, base_args: List[str], index: int, summary_dir: Optional[Path],
              gpus: Sequence[int] = ()) -> List[str]:
    """Per-peer overrides appended after the user's flags (the last occurrence of a flag wins)."""
    args = list(base_args)
    args += ["--events", str(events_path(config, index))]
    if gpus:
        args += ["--device", f"cuda:{gpus[index]}"]
    port = config.monitoring.metrics_port
    args += ["--metrics-port", str(port + index if isinstance(port, int) and port else port)]
    args += ["--checkpoint-dir", str(config.checkpoint.checkpoint_dir / f"peer-{index}")]
    if config.training.seed is not None:  # each peer reads in its own order: the one given, then the next ones
        args += ["--seed", str(config.training.seed + index)]
    if config.dht.identity is not None:  # one key per peer: two peers with one identity would clash
        args += ["--identity", f"{config.dht.identity}.peer-{index}"]
    if "--host-maddrs" not in base_args:
        args += ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    if summary_dir is not None:
        args += ["--summary-json", str(summary_dir / f"peer-{index}.json")]
    return args


def run_local_swarm(config: PeerConfig, num_peers: int, summary_dir: Optional[Path], base_args: List[str],
                    command: preforked.Command, gpus: Sequence[int] = ()) -> int:
    """On the CPU, every peer is forked from this process once it has imported torch and hivemind
    (peer/process/preforked.py), and runs its `peer start` with `command`: they share those pages and skip the
    import. A GPU peer starts as a new program: a process that has touched CUDA cannot fork a working child."""
    children: List[Preforked] = []
    if not gpus:  # prepare_cpu_peers() has run
        preload_peer_modules()
        children = preforked.prefork(num_peers, functools.partial(forked_peer, command))
    try:
        return asyncio.run(_run_local_swarm(config, num_peers, summary_dir, base_args, gpus, children))
    finally:
        for child in children:
            child.discard()  # those never launched (a stop came first)


def preload_peer_modules() -> None:
    """Import here what a forked peer imports before it trains: the peers share these pages instead of each
    importing its own copy (seconds of CPU each, while the others start too, and memory of its own)."""
    # torch imports its compiler lazily, in every optimizer's constructor: 2 CPU seconds a peer on this machine
    import torch._dynamo  # noqa: F401

    from peer.cli import start  # noqa: F401 (torch, hivemind and the peer's own modules)


def forked_peer(command: preforked.Command, argv: List[str]) -> int:
    """A forked child's `peer` command (`peer swarm`'s peers, the fork server's children), with hivemind locks of its
    own (not shared with the other peers)."""
    from averaging import adapter  # preloaded: torch must not be imported before the threads are set

    adapter.make_own_locks()
    return command(argv)


async def _run_local_swarm(config: PeerConfig, num_peers: int, summary_dir: Optional[Path], base_args: List[str],
                           gpus: Sequence[int], children: Sequence[Preforked]) -> int:
    peers: List[Peer] = []
    stopping = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stopping.is_set():
            for peer in peers:
                peer.kill()
            return
        stopping.set()
        click.echo(f"[swarm] {signal.Signals(signum).name}: stopping {len(peers)} peer(s)", err=True)
        for peer in peers:
            peer.terminate()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)

    try:
        config.checkpoint.checkpoint_dir.mkdir(parents=True, exist_ok=True)  # where the events files go by default
    except OSError:
        pass  # peer 0 refuses the directory in one line, and exits
    first = local_peer(config, 0, peer_args(config, base_args, 0, summary_dir, gpus), children)
    peers.append(first)
    if config.dht.initial_peers:
        join = ["--initial-peers", ",".join(config.dht.initial_peers)]  # joining an existing swarm: everyone uses it
    else:
        ready = await _ready(first, stopping)
        if ready is None:
            if not stopping.is_set():
                click.echo("[swarm] peer-0 exited or was not ready in time; not starting the others", err=True)
                on_signal(signal.SIGTERM)
            return await _wait_all(peers)
        join = ["--initial-peers", ready.multiaddrs[0]]
        if ready.run_owner is not None and config.dht.run_owner is None:  # as the join command peer-0 printed
            join += ["--run-owner", ready.run_owner]
    for index in range(1, num_peers):
        if stopping.is_set():
            break
        peers.append(local_peer(config, index, peer_args(config, base_args, index, summary_dir, gpus) + join,
                                children))
    return await _wait_all(peers)


async def _ready(first: Peer, stopping: asyncio.Event) -> Optional[Ready]:
    """Peer 0's ready event, once it has an address; None if it exits, a stop comes, or time runs out."""
    ready = asyncio.ensure_future(first.ready(BOOTSTRAP_TIMEOUT_SECONDS))
    stopped = asyncio.ensure_future(stopping.wait())
    await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not ready.done():
        ready.cancel()
        return None
    try:
        event = ready.result()
    except PeerFailed:
        return None
    return event if event.multiaddrs else None


async def _wait_all(peers: List[Peer]) -> int:
    """Wait for every peer, saying when each exits; a peer that fails makes the swarm's exit code 1."""
    async def exit_code(peer: Peer) -> int:
        code = await peer.exit_code(math.inf)
        click.echo(f"[swarm] {peer.name} exited with code {code}", err=True)
        return code

    codes = await asyncio.gather(*(exit_code(peer) for peer in peers))
    failed = [peer.name for peer, code in zip(peers, codes) if code != 0]
    if failed:
        click.echo(f"[swarm] failed: {', '.join(failed)}", err=True)
        return ExitCode.FAILED
    return ExitCode.OK
