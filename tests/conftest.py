"""Shared options, the integration marker and the order of the tests.

Tests live in folders by kind: unit/ (no process, no network), inprocess/ (real hivemind DHTs and averagers in
this process), swarm/ and reliability/ (real `peer start` processes on 127.0.0.1), meta/ (the repository itself:
layout, docs, help, deploy files). A test's folder gives it the `integration` marker, so that
`pytest -m "not integration"` runs the fast part. Peer processes run under the harness (peer/testing/), which
kills them at teardown, on every path."""
from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import yaml

from peer.process.fork_server import ForkServer
from peer.testing import harness
from tests.peers import REPO_ROOT
from tests.system_tools import system_tool

DURATIONS = Path(__file__).with_name("durations.json")
# a test that durations.json does not list (one added since, or under a second): a multi-peer test takes tens of
# seconds, any other well under one
UNLISTED_INTEGRATION_SECONDS = 20.0
UNLISTED_OTHER_SECONDS = 0.1
LISTED_FROM_SECONDS = 1.0
# the folders whose tests start real multi-peer swarms (relative to the repository root)
INTEGRATION_FOLDERS = ("tests/swarm/", "tests/reliability/", "examples/")


def pytest_addoption(parser) -> None:
    parser.addoption("--soak-seconds", type=float, default=30.0,
                     help="How long the churn soak kills and restarts peers (default: 30, as in CI: with its "
                          "seed, a SIGKILL, a restart, a SIGTERM and a restart).")
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help=f"After the run, write the seconds of each test that took {LISTED_FROM_SECONDS:.0f} s or "
                          "more (setup, call and teardown) to PATH as JSON: how tests/durations.json is made.")


@pytest.fixture(scope="session", autouse=True)
def peers_forked_from_a_server():
    """Every test's harness peers (not `peer swarm`, nor one under a prefix) are forked by one server per pytest
    worker, which has imported torch and hivemind once, instead of each importing them as a new program: about 5
    of a peer's 8-10 CPU seconds to `ready`, on a machine the suite keeps busy. The server starts on the first
    peer, so a worker that starts none does not pay for it."""
    server = ForkServer()
    harness.fork_peers_from(server)
    try:
        yield server
    finally:
        harness.fork_peers_from(None)
        server.close()


@pytest.fixture
def soak_seconds(request) -> float:
    return request.config.getoption("--soak-seconds")


def pytest_collection_modifyitems(config, items: List[pytest.Item]) -> None:
    """Longest first, in one slice per pytest-xdist worker, the slices about equally long.

    The worksteal scheduler (pyproject.toml) first hands each worker a contiguous slice of this list, equal in
    count; a worker that runs dry then takes the tail of the longest queue. So each slice gets about the same
    expected seconds, its longest tests first, and ends with short ones: a long test started last would finish
    alone while the other workers idle (with the files in their order, one worker ran out 50 s before another).
    Expected seconds come from tests/durations.json, a measured run of the suite.
    """
    for item in items:
        if item.nodeid.startswith(INTEGRATION_FOLDERS):
            item.add_marker(pytest.mark.integration)
    expected = _expected_seconds(config)
    units: Dict[str, List[pytest.Item]] = {}
    for item in items:
        units.setdefault(_unit(item), []).append(item)
    ranked = sorted(units.values(), key=lambda unit: sum(map(expected, unit)), reverse=True)  # stable
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    items[:] = [item for part in _deal(ranked, workers, expected) for unit in part for item in unit]


def _unit(item: pytest.Item) -> str:
    """What must run on one worker: the tests marked same_worker with one name (they share a costly module
    fixture, which each worker would otherwise set up again), else each test alone."""
    mark = item.get_closest_marker("same_worker")
    return f"same_worker:{mark.args[0]}" if mark else item.nodeid


def _deal(units: List[List[pytest.Item]], parts: int, seconds: Callable[[pytest.Item], float]
          ) -> List[List[List[pytest.Item]]]:
    """Split `units`, longest first, into `parts` slices of about the sizes that xdist cuts (its first worker
    gets len // parts tests, and so on), each next unit going to the slice with room and the fewest seconds."""
    sizes, left = [], sum(map(len, units))
    for remaining in range(parts, 0, -1):
        sizes.append(left // remaining)
        left -= sizes[-1]
    slices: List[List[List[pytest.Item]]] = [[] for _ in range(parts)]
    counts, totals = [0] * parts, [0.0] * parts
    for unit in units:
        roomy = [i for i in range(parts) if counts[i] + len(unit) <= sizes[i]] or range(parts)
        index = min(roomy, key=lambda i: totals[i])
        slices[index].append(unit)
        counts[index] += len(unit)
        totals[index] += sum(map(seconds, unit))
    return slices


def _expected_seconds(config) -> Callable[[pytest.Item], float]:
    recorded: Dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    soak = config.getoption("--soak-seconds")

    def seconds(item: pytest.Item) -> float:
        listed = recorded.get(item.nodeid)
        if listed is None:
            integration = item.get_closest_marker("integration") is not None
            listed = UNLISTED_INTEGRATION_SECONDS if integration else UNLISTED_OTHER_SECONDS
        if "soak_seconds" in getattr(item, "fixturenames", ()):
            return max(listed, soak)  # `--soak-seconds 3600` is the longest by far
        return listed

    return seconds


def pytest_configure(config) -> None:
    path = config.getoption("--record-durations")
    if path and not hasattr(config, "workerinput"):  # the controller sees every worker's reports
        config.pluginmanager.register(DurationRecorder(Path(path)), "record-durations")


class DurationRecorder:
    def __init__(self, path: Path):
        self.path = path
        self.seconds: Dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] += report.duration

    def pytest_sessionfinish(self) -> None:
        listed = {nodeid: round(seconds, 1) for nodeid, seconds in sorted(self.seconds.items())
                  if seconds >= LISTED_FROM_SECONDS}
        self.path.write_text(json.dumps(listed, indent=1) + "\n")


# --- the system tools that check deploy/ (tests/meta/test_deploy.py, tests/swarm/test_deploy_live.py)

@pytest.fixture(scope="session")
def docker_compose() -> str:
    return system_tool("docker-compose", "docker-compose")


@pytest.fixture(scope="session")
def promtool() -> str:
    return system_tool("promtool", "prometheus")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return system_tool("prometheus", "prometheus")


@pytest.fixture(scope="module")
def compose(docker_compose: str) -> Dict:
    """The compose file as docker-compose resolves it (anchors merged, paths absolute)."""
    result = subprocess.run([docker_compose, "-f", str(REPO_ROOT / "deploy" / "docker-compose.yml"), "config"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)
