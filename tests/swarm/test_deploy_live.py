"""deploy/ against live processes: the compose bootstrap flow run as processes on 127.0.0.1, and every dashboard
query sent to a real Prometheus that scrapes a live 2-peer swarm and `peer monitor` with the scrape jobs of
deploy/prometheus/prometheus.yml. The file checks alone are in tests/meta/test_deploy.py.
"""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
import yaml

from peer.testing import Peer, Swarm, until
from tests.meta.test_deploy import (
    CUDA_ONLY_PANELS,
    GRAFANA_INTERVAL,
    LOCAL_HTTP,
    PROMETHEUS_CONFIG,
    TOOL_TIMEOUT_SECONDS,
    command_of,
    flag_value,
    image_healthcheck,
    panel_queries,
    variable_queries,
)
from tests.peers import FAST_SWARM_ARGS, wait_until


@pytest.mark.timeout(180)
async def test_compose_bootstrap_flow_runs_here(compose: Dict, tmp_path: Path):
    """The compose commands, health check and environment, run as processes on 127.0.0.1.

    Only the container paths, the ports and the host names are rewritten; the DNS form of the
    address is kept (localhost in place of the service name `bootstrap`).
    """
    port, monitor_port = free_ports(2)
    (tmp_path / "state").mkdir()

    def local(word: str) -> str:
        if word == "9100":
            return str(monitor_port)
        for container, here in (("/shared/", f"{tmp_path}/"), ("/var/lib/swarmtrain/", f"{tmp_path}/state/"),
                                ("/dns4/bootstrap/", "/dns4/localhost/"), ("/ip4/0.0.0.0/", "/ip4/127.0.0.1/"),
                                ("31337", str(port))):
            word = word.replace(container, here)
        return word

    services = compose["services"]
    healthcheck = services["bootstrap"]["healthcheck"]["test"]
    assert healthcheck[:3] == ["CMD", "python", "-c"]

    def healthy() -> bool:
        return subprocess.run([sys.executable, "-c", local(healthcheck[3])], capture_output=True,
                              timeout=TOOL_TIMEOUT_SECONDS).returncode == 0

    async with Swarm(tmp_path) as swarm:
        def launch(name: str, service: str, *extra: str) -> Peer:
            """The service's command and environment, as a process of the swarm."""
            command, *args = map(local, command_of(services[service]))
            return swarm.run(command, *args, *extra, name=name, env=services[service]["environment"])

        assert not healthy(), "healthy before the bootstrap node started"
        bootstrap = launch("bootstrap", "bootstrap")
        await until(healthy, 60, "the compose health check of the bootstrap node")
        address_file = Path(local(flag_value(command_of(services["bootstrap"]), "--write-maddrs")))
        address = address_file.read_text()
        assert address.startswith(f"/dns4/localhost/tcp/{port}/p2p/"), address

        # The peer service's command and environment; flags only shrink the run for a test.
        peer = launch("peer", "peer", *FAST_SWARM_ARGS, "--min-peers", "1", "--max-seconds", "120", "--metrics-port",
                      "0", "--checkpoint-dir", str(tmp_path / "ckpt"))
        monitor = launch("monitor", "monitor")
        # the monitor is healthy while it sees a live peer (503 with none)
        await until(lambda: image_healthcheck(monitor_port).returncode == 0 or monitor.process.poll() is not None, 60,
                    "the monitor's /healthz while a peer trains")
        assert image_healthcheck(monitor_port).returncode == 0, monitor.log_tail()
        peer.terminate()
        assert await peer.exit_code(timeout=60) == 0, peer.log_tail()

        # Restarted, the node keeps its identity, so the address peers read stays right.
        bootstrap.terminate()
        assert await bootstrap.exit_code(timeout=30) == 0, bootstrap.log_tail()
        address_file.unlink()
        launch("bootstrap-again", "bootstrap")
        await until(healthy, 60, "the restarted bootstrap node")
        assert address_file.read_text() == address


# --- every panel against a real Prometheus scraping a live swarm --------------------------

def free_ports(count: int) -> List[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def local_prometheus_config(targets: Dict[str, List[str]]) -> Dict:
    """deploy's scrape jobs as they are, with static 127.0.0.1 targets for their discovery, every 1 s."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    assert {job["job_name"] for job in config["scrape_configs"]} == set(targets)
    for job in config["scrape_configs"]:
        for key in [key for key in job if key.endswith("_sd_configs") or key == "static_configs"]:
            del job[key]
        job.pop("scrape_interval", None)
        job.pop("scrape_timeout", None)
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    return config


class Prometheus:
    """A Prometheus process on 127.0.0.1 with storage in a temp dir; stop() ends it on every path."""

    def __init__(self, binary: str, config: Dict, workdir: Path):
        self.port = free_ports(1)[0]
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [binary, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{self.log_path.read_text()}")
        try:
            with LOCAL_HTTP.open(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> List[Dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with LOCAL_HTTP.open(url, timeout=10) as response:
                return json.loads(response.read())["data"]
        except urllib.error.HTTPError as e:  # a bad query: fail loudly, never retry it
            raise AssertionError(f"{params}: {e.code} {e.read().decode(errors='replace')}") from None

    def query(self, expr: str) -> List[Dict]:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


class LiveSwarm:
    def __init__(self, prometheus: Prometheus, instances: List[str], peers: List[Peer], monitor: Peer):
        self.prometheus, self.instances, self.peers, self.monitor = prometheus, instances, peers, monitor

    def logs(self) -> str:
        return "\n".join(process.log_tail(1500) for process in [*self.peers, self.monitor])


# the tests that share live_swarm: one pytest-xdist worker runs them all, so its swarm starts once
ON_ONE_WORKER = pytest.mark.same_worker("live_swarm")


@pytest.fixture(scope="module")
def live_swarm(prometheus_binary: str, tmp_path_factory) -> Iterator[LiveSwarm]:
    """Two `peer start` processes, `peer monitor`, and Prometheus scraping them.

    Module-scoped so the peer panels and the monitor panels share one swarm; the harness kills every
    process at teardown.
    """
    workdir = tmp_path_factory.mktemp("live-swarm")
    [monitor_port] = free_ports(1)
    swarm = Swarm(workdir, *FAST_SWARM_ARGS, "--min-peers", "2", "--target-batch-size", "32", "--max-seconds", "600",
                  "--metrics-host", "127.0.0.1")
    prometheus = None
    try:
        peers = asyncio.run(swarm.start(2))
        monitor = swarm.run("monitor", "--initial-peers", peers[0].address, "--metrics-port", str(monitor_port),
                            "--target-batch-size", "32", "--metrics-host", "127.0.0.1", name="monitor")
        instances = [urllib.parse.urlsplit(peer.metrics_url).netloc for peer in peers]
        config = local_prometheus_config({"peer": instances, "monitor": [f"127.0.0.1:{monitor_port}"]})
        prometheus = Prometheus(prometheus_binary, config, workdir)
        wait_until(prometheus.ready, 60, message="prometheus /-/ready")
        yield LiveSwarm(prometheus, instances, peers, monitor)
    finally:
        if prometheus is not None:
            prometheus.stop()
        asyncio.run(swarm.close())


def grafana_to_promql(expr: str, instance: str) -> str:
    """What Grafana would send: its interval variables become a fixed window, $peer one instance."""
    for variable in ("$__rate_interval", "$__interval", "$__range"):
        expr = expr.replace(variable, GRAFANA_INTERVAL)
    return expr.replace("$peer", instance)


def wait_for_data(swarm: LiveSwarm, queries: List[Tuple[str, str, str]], timeout: float,
                  processes: List[Peer]) -> List[str]:
    """Poll until every query returns a series; returns those still empty at the deadline."""
    empty: List[str] = []

    def all_have_data() -> bool:
        for process in processes:
            if process.process.poll() is not None:  # no point waiting out the timeout
                raise RuntimeError(f"{process.name} exited early:\n{swarm.logs()}")
        empty[:] = [f"{board} / {panel}: {expr}" for board, panel, expr in queries
                    if not swarm.prometheus.query(grafana_to_promql(expr, swarm.instances[0]))]
        return not empty

    try:
        wait_until(all_have_data, timeout, interval=2.0, message="every panel query to return data")
    except TimeoutError:
        pass
    return empty


@ON_ONE_WORKER
@pytest.mark.timeout(300)
def test_every_peer_panel_query_returns_data(live_swarm: LiveSwarm):
    peer_queries = [q for q in panel_queries() if 'job="monitor"' not in q[2]]
    assert set(CUDA_ONLY_PANELS) <= {(board, panel) for board, panel, _ in peer_queries}, "stale allowlist"
    cuda_only = [q for q in peer_queries if (q[0], q[1]) in CUDA_ONLY_PANELS]
    checked = [q for q in peer_queries if (q[0], q[1]) not in CUDA_ONLY_PANELS]

    empty = wait_for_data(live_swarm, checked, timeout=150, processes=live_swarm.peers)
    assert not empty, "queries with no data:\n" + "\n".join(empty) + "\n" + live_swarm.logs()
    for _, _, expr in cuda_only:  # may be empty on CPU, but must still be a valid query
        live_swarm.prometheus.query(grafana_to_promql(expr, live_swarm.instances[0]))

    # The dashboards' `peer` variable lists both peers.
    for selector in variable_queries():
        series = live_swarm.prometheus.api("series", **{"match[]": selector})
        assert {s["instance"] for s in series} == set(live_swarm.instances), selector


@ON_ONE_WORKER
def test_image_healthcheck_passes_against_a_live_peer(live_swarm: LiveSwarm):
    result = image_healthcheck(int(live_swarm.instances[0].rsplit(":", 1)[1]))
    assert result.returncode == 0, result.stderr
    assert image_healthcheck(free_ports(1)[0]).returncode != 0, "the health check must fail when nothing answers"


@ON_ONE_WORKER
@pytest.mark.timeout(300)
def test_every_monitor_panel_query_returns_data(live_swarm: LiveSwarm):
    monitor_queries = [q for q in panel_queries() if 'job="monitor"' in q[2]]
    assert monitor_queries
    wait_until(lambda: live_swarm.prometheus.query('up{job="monitor"} == 1'), 60, message="monitor scraped")
    empty = wait_for_data(live_swarm, monitor_queries, timeout=120,
                          processes=[*live_swarm.peers, live_swarm.monitor])
    assert not empty, "queries with no data:\n" + "\n".join(empty) + "\n" + live_swarm.logs()
