"""`peer swarm` gives each peer torch threads for its share of the cores, unless the user chose them."""
from __future__ import annotations

import subprocess
import sys

from peer.cli.swarm import threads_per_peer
from tests.new_process import TIMEOUT_SECONDS, environment_without, python_result

SET_FOR_THE_PEERS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HIVEMIND_MEMORY_SHARING_STRATEGY", "GOGC")


def test_each_peer_gets_its_share_of_the_cores_and_at_least_one_thread(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_peer(1, 8) == {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}
    assert threads_per_peer(3, 8)["OMP_NUM_THREADS"] == "2"
    assert threads_per_peer(16, 2)["OMP_NUM_THREADS"] == "1"


def test_the_users_choice_of_threads_stands(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert threads_per_peer(16, 2) == {}


def result_in_new_process(code: str):
    return python_result(code, env=environment_without(SET_FOR_THE_PEERS))


def test_the_cpu_peers_a_swarm_forks_get_their_threads_share_tensors_by_descriptor_and_bound_p2pds_heap():
    """torch and hivemind read these as they are imported, and the peers inherit what the swarm process imported."""
    result = result_in_new_process(
        "import json, os\nfrom peer.cli.swarm import prepare_cpu_peers\n"
        "prepare_cpu_peers(4 * len(os.sched_getaffinity(0)))\n"
        "import hivemind, torch, torch.multiprocessing\n"
        "print(json.dumps([torch.get_num_threads(), torch.multiprocessing.get_sharing_strategy(),\n"
        "                  os.environ['GOGC']]))")
    assert result == [1, "file_descriptor", "50"]


def test_preparing_the_peers_after_torch_was_imported_is_refused():
    result = subprocess.run([sys.executable, "-c", "import torch\nfrom peer.cli.swarm import prepare_cpu_peers\n"
                             "prepare_cpu_peers(2)"], env=environment_without(SET_FOR_THE_PEERS),
                            capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    assert result.returncode != 0
    assert "torch was imported before the peers' threads were set" in result.stderr


def test_the_swarm_process_imports_what_a_peer_would_import_after_the_fork():
    """Each forked peer would otherwise import its own copy of torch's compiler, as its optimizer is built: 2 CPU
    seconds a peer while the others start too, and memory it shares with nobody."""
    result = result_in_new_process(
        "import json, sys\nfrom peer.cli.swarm import preload_peer_modules\npreload_peer_modules()\n"
        "from peer.tasks.registry import load_task\ntask = load_task('bytelm-tiny')\n"
        "before = set(sys.modules)\ntask.build_optimizer(task.build_model().parameters())\n"
        "print(json.dumps(sorted(name for name in set(sys.modules) - before if name.startswith('torch'))))")
    assert result == []
