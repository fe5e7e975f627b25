"""Shared fixtures. Every process a test starts is killed at teardown, on every path."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, List

import pytest

from tests.peers import PeerProcess


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """spawn(name, *args, env=None) -> PeerProcess running `peer <args>` with its log in tmp_path/name.log."""
    started: List[PeerProcess] = []

    def _spawn(name: str, *args: str, env=None) -> PeerProcess:
        process = PeerProcess(tmp_path / f"{name}.log", list(args), env=env)
        started.append(process)
        return process

    try:
        yield _spawn
    finally:
        for process in started:
            process.kill_everything()


def pytest_addoption(parser) -> None:
    parser.addoption("--soak-seconds", type=float, default=90.0,
                     help="How long the churn soak kills and restarts peers (default: 90, as in CI).")


@pytest.fixture
def soak_seconds(request) -> float:
    return request.config.getoption("--soak-seconds")


def pytest_collection_modifyitems(config, items: List[pytest.Item]) -> None:
    """Longest first: the soak, then the multi-peer swarms, then the rest.

    The suite runs on two workers that steal work from each other (pyproject.toml), so a long
    test started last would finish alone; started first, the short ones fill in around it.
    """
    def expected_length(item: pytest.Item) -> int:
        if "soak_seconds" in getattr(item, "fixturenames", ()):
            return 0
        return 1 if item.get_closest_marker("integration") else 2

    items.sort(key=expected_length)  # stable: files keep their order within each class
