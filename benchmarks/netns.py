"""Network namespaces on one bridge, each peer's egress rate-limited with `tc tbf` (root only).

`Bridge(n)` creates namespaces <tag>p0..<tag>p{n-1}, each with one veth into a bridge that
lives in its own hub namespace, addresses 10.89.0.1..n/24, and loopback up. `set_rate("100mbit")`
shapes every peer's egress with a token bucket (`tbf`); `set_rate(None)` removes the shaping; `limit_link(i,
"2mbit")` shapes one peer's link both ways.
Names carry this process's id, so benchmarks running at the same time never collide, and
`down()` (also on leaving the `with` block, on every path) deletes everything it created.
`cut([0, 1], [2, 3])` partitions the peers: each group after the first moves to a bridge of its own
(peers in no group stay with the first), so that peers of a group still reach each other and nobody
else; `restore()` puts every peer back on the one bridge. Their links stay up the whole time, as
when a router between two sites fails: packets across the cut are lost, not refused.
Processes started inside a namespace must be stopped before `down()`: deleting a namespace
only removes its name while processes still run in it.

netem (delay, loss) is not used: only rate limits. Nothing here runs unless the caller asks.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Sequence

SUBNET = "10.89.0"
TBF_LATENCY = "100ms"
MIN_BURST_BYTES = 256 * 1024


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def rate_bits_per_second(rate: str) -> float:
    """'100mbit' -> 1e8; understands kbit, mbit, gbit (tc's units, powers of 1000)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    rate = rate.strip().lower()
    for suffix, factor in units.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * factor
    raise ValueError(f"rate {rate!r} must end in kbit, mbit or gbit (e.g. 100mbit)")


def unavailable_reason() -> Optional[str]:
    """Why namespaces cannot be used here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root; ran on 127.0.0.1 without rate limits instead"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed; ran on 127.0.0.1 without rate limits instead"
    probe = f"stbprobe{os.getpid() % 100000}"
    try:
        _run("ip", "netns", "add", probe)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"cannot create a network namespace ({e}); ran on 127.0.0.1 without rate limits instead"
    _run("ip", "netns", "del", probe, check=False)
    return None


def finished_without_namespaces(run, name: str, results: dict) -> bool:
    """When namespaces cannot be used here: note why, write `results` with `skipped` set, and say True."""
    reason = unavailable_reason()
    if not reason:
        return False
    reason = reason.split(";")[0]
    results["skipped"] = reason
    run.note(f"skipped: {reason}")
    run.finish(results, f"{name}: skipped ({reason})")
    return True


def remove_stale() -> list:
    """Delete namespaces that an earlier, killed run of these benchmarks left behind (their process is gone)."""
    listed = _run("ip", "netns", "list", check=False).stdout.split()
    removed = []
    for name in listed:
        match = re.fullmatch(r"stb(\d+)(hub|p\d+)", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


async def start_peers(swarm, bridge: "Bridge", count: int, timeout: float) -> list:
    """`count` peers of a harness Swarm (peer/testing/), peer i in namespace i on its bridge address, all ready (the
    first before the others join through it)."""
    peers = [await swarm.add("--host-maddrs", f"/ip4/{bridge.ip(index)}/tcp/0", name=f"peer-{index}",
                             namespace=bridge.namespaces[index], ready=index == 0, timeout=timeout)
             for index in range(count)]
    await asyncio.gather(*(peer.ready(timeout) for peer in peers))
    return peers


def _shape(namespace: str, device: str, rate: Optional[str]) -> None:
    """A token bucket on `device`'s egress in `namespace` (None: remove it)."""
    if rate is None:
        _run("ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root", check=False)
        return
    # the bucket must hold at least one timer tick's worth of bytes, or tbf cannot reach the rate
    burst = max(MIN_BURST_BYTES, int(rate_bits_per_second(rate) / 8 / 250))
    _run("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
         "burst", str(burst), "latency", TBF_LATENCY)


class Bridge:
    def __init__(self, peers: int, tag: Optional[str] = None):
        tag = tag or f"stb{os.getpid() % 100000}"
        self.peers = peers
        self.hub = f"{tag}hub"
        self.namespaces = [f"{tag}p{i}" for i in range(peers)]
        self._peer_if = [f"{tag}v{i}" for i in range(peers)]  # at most 15 characters: stb + 5 digits + v + 2
        self._hub_if = [f"{tag}h{i}" for i in range(peers)]
        self._created: List[str] = []
        self.rate: Optional[str] = None
        self.groups: Optional[List[List[int]]] = None
        """The groups of the cut in force (cut()), or None while every peer is on one bridge."""

    def ip(self, index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def exec_prefix(self, index: int) -> List[str]:
        return ["ip", "netns", "exec", self.namespaces[index]]

    def up(self) -> "Bridge":
        try:
            _run("ip", "netns", "add", self.hub)
            self._created.append(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.namespaces):
                _run("ip", "netns", "add", ns)
                self._created.append(ns)
                _run("ip", "link", "add", self._peer_if[i], "type", "veth", "peer", "name", self._hub_if[i])
                _run("ip", "link", "set", self._peer_if[i], "netns", ns)
                _run("ip", "link", "set", self._hub_if[i], "netns", self.hub)
                _run("ip", "-n", self.hub, "link", "set", self._hub_if[i], "master", "br0")
                _run("ip", "-n", self.hub, "link", "set", self._hub_if[i], "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", self._peer_if[i])
                _run("ip", "-n", ns, "link", "set", self._peer_if[i], "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        return self

    def set_rate(self, rate: Optional[str]) -> None:
        """Shape every peer's egress to `rate` (tc syntax, e.g. 100mbit), or remove shaping (None)."""
        for i, ns in enumerate(self.namespaces):
            _shape(ns, self._peer_if[i], rate)
        self.rate = rate

    def limit_link(self, index: int, rate: Optional[str]) -> None:
        """Shape peer `index`'s link both ways to `rate`: its upload at its end, its download at the hub's end (None
        removes both)."""
        _shape(self.namespaces[index], self._peer_if[index], rate)
        _shape(self.hub, self._hub_if[index], rate)

    def cut(self, *groups: Sequence[int]) -> None:
        """Partition the peers into `groups` (peer indices): each group reaches only its own members.

        Group k > 0 moves to bridge br<k> in the hub namespace; the first group and any peer in no group stay
        on br0. A cut replaces the one in force."""
        seen = [index for group in groups for index in group]
        if len(seen) != len(set(seen)) or not all(0 <= index < self.peers for index in seen):
            raise ValueError(f"groups must name distinct peers among 0..{self.peers - 1} (got {groups})")
        self.restore()
        self.groups = [list(group) for group in groups]  # first: restore() undoes a cut that fails half-way
        for k, group in enumerate(groups[1:], start=1):
            _run("ip", "-n", self.hub, "link", "add", f"br{k}", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", f"br{k}", "up")
            for index in group:
                _run("ip", "-n", self.hub, "link", "set", self._hub_if[index], "master", f"br{k}")

    def restore(self) -> None:
        """Undo cut(): every peer on bridge br0 again (a no-op without a cut)."""
        if self.groups is None:
            return
        for k, group in enumerate(self.groups[1:], start=1):
            for index in group:
                _run("ip", "-n", self.hub, "link", "set", self._hub_if[index], "master", "br0")
            _run("ip", "-n", self.hub, "link", "del", f"br{k}", check=False)
        self.groups = None

    def traffic(self, index: int) -> Dict[str, int]:
        """Bytes peer `index` has sent (`tx`) and received (`rx`) on its link so far: everything on the wire,
        IP and TCP headers, DHT and libp2p framing included (the interface's own counters)."""
        out = _run("ip", "-n", self.namespaces[index], "-s", "-j", "link", "show", "dev", self._peer_if[index]).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}

    def down(self) -> None:
        """Delete every namespace this bridge created (veth pairs and the bridge go with them)."""
        for ns in reversed(self._created):
            _run("ip", "netns", "del", ns, check=False)
        if self._created:  # a veth pair left in this namespace by a failed up()
            for name in self._peer_if:
                _run("ip", "link", "del", name, check=False)
        self._created.clear()

    def __enter__(self) -> "Bridge":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
