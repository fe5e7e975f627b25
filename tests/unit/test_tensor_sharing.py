"""A peer shares tensors by file descriptor (no torch_shm_manager), unless the environment names a strategy, and
may hold as many open files as the hard limit allows (peer/process/tensor_sharing.py)."""
from __future__ import annotations

from tests.new_process import environment_without, python_result

CHECK = """
import json, resource
from peer.process.tensor_sharing import share_tensors_by_descriptor
share_tensors_by_descriptor()
import hivemind, torch.multiprocessing
print(json.dumps({"strategy": torch.multiprocessing.get_sharing_strategy(),
                  "limits": resource.getrlimit(resource.RLIMIT_NOFILE)}))
"""


def sharing_in_new_process(env: dict) -> dict:
    return python_result(CHECK, env=env)


def without_strategy() -> dict:
    return environment_without(["HIVEMIND_MEMORY_SHARING_STRATEGY"])


def test_tensors_are_shared_by_descriptor_with_the_soft_limit_of_open_files_raised():
    found = sharing_in_new_process(without_strategy())
    assert found["strategy"] == "file_descriptor"  # hivemind alone would set file_system
    soft, hard = found["limits"]
    assert soft == hard


def test_a_strategy_the_user_set_stands():
    found = sharing_in_new_process({**without_strategy(), "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_system"})
    assert found["strategy"] == "file_system"
