"""`peer swarm` gives each peer torch threads for its share of the cores, unless the user chose them."""
from __future__ import annotations

from peer.cli.swarm import threads_per_peer


def test_each_peer_gets_its_share_of_the_cores_and_at_least_one_thread(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_peer(1, 8) == {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}
    assert threads_per_peer(3, 8)["OMP_NUM_THREADS"] == "2"
    assert threads_per_peer(16, 2)["OMP_NUM_THREADS"] == "1"


def test_the_users_choice_of_threads_stands(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert threads_per_peer(16, 2) == {}
