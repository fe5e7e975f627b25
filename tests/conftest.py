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
    parser.addoption("--soak-seconds", type=float, default=180.0,
                     help="How long the churn soak kills and restarts peers (default: 180, as in CI).")


@pytest.fixture
def soak_seconds(request) -> float:
    return request.config.getoption("--soak-seconds")


# Swarms of three or more peers: run one at a time (on one xdist worker), so that two of them never
# share the machine's cores; everything else spreads over the other worker.
CROWDED_SWARMS = {
    "test_churn_soak",
    "test_peer_killed_mid_round_survivors_go_on_and_it_catches_up_after_restart",
    "test_three_peers_train_in_lock_step",
    "test_late_joiner_downloads_state_then_restart_resumes_from_checkpoint",
    "test_nan_gradients_are_dropped_or_discarded_and_training_goes_on",
    "test_peer_with_wrong_key_cannot_join_a_round",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.originalname in CROWDED_SWARMS:
            item.add_marker(pytest.mark.xdist_group("crowded-swarms"))
