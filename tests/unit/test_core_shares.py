"""`peer swarm` puts each peer on its share of the cores, with as many torch threads as cores in the share."""
from __future__ import annotations

import os
import subprocess
import sys

from peer.cli.swarm import CoreShare, core_shares, describe_shares
from peer.process.launcher import _before_exec


def test_no_more_peers_than_cores_get_disjoint_cores_that_cover_the_machine():
    shares = core_shares(3, [7, 0, 1, 2, 3, 4, 5, 6])
    assert [sorted(share.cpus) for share in shares] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [share.threads for share in shares] == [3, 3, 2]
    assert core_shares(1, [0, 1]) == [CoreShare(frozenset({0, 1}), 2)]


def test_more_peers_than_cores_get_one_core_each_dealt_in_turn():
    shares = core_shares(5, [2, 3])
    assert [sorted(share.cpus) for share in shares] == [[2], [3], [2], [3], [2]]
    assert {share.threads for share in shares} == {1}


def test_the_share_sets_torch_threads_unless_the_user_chose_them(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert CoreShare(frozenset({0, 1}), 2).env() == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    assert "2 each" in describe_shares([CoreShare(frozenset({0, 1}), 2)])
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert CoreShare(frozenset({0, 1}), 2).env() == {}
    assert "as OMP_NUM_THREADS says" in describe_shares([CoreShare(frozenset({0, 1}), 2)])


def test_a_launched_process_runs_on_its_share_only():
    core = min(os.sched_getaffinity(0))
    probe = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           preexec_fn=_before_exec(False, frozenset({core})), capture_output=True, text=True,
                           timeout=60, check=True)
    assert probe.stdout.strip() == str([core])

