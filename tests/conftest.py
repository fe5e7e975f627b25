"""Shared options and the order of the tests. Peer processes run under the harness (peer/testing.py),
which kills them at teardown, on every path."""
from __future__ import annotations

from typing import List

import pytest


def pytest_addoption(parser) -> None:
    parser.addoption("--soak-seconds", type=float, default=30.0,
                     help="How long the churn soak kills and restarts peers (default: 30, as in CI: with its "
                          "seed, a SIGKILL, a restart, a SIGTERM and a restart).")


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
