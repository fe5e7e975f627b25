"""A peer freezes Python's collector before it forks a helper process (peer/process/fork_sharing.py): the child's
collections then leave the pages of the parent's objects shared instead of copying them."""
from __future__ import annotations

from tests.new_process import python_result

CHECK = """
import gc, json, os, sys, psutil
from peer.process.fork_sharing import freeze_before_fork
objects = [[index] for index in range(300_000)]  # lists: always tracked by the collector (about 20 MiB of pages)
if sys.argv[1] == "freeze":
    freeze_before_fork()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    gc.collect()
    os.write(write, json.dumps(psutil.Process().memory_full_info().uss).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(json.loads(os.read(read, 64)))
"""


def private_bytes_of_a_child_after_a_collection(mode: str) -> int:
    return python_result(CHECK, mode)


def test_a_child_forked_after_the_freeze_copies_none_of_the_parents_objects_as_it_collects():
    copied = private_bytes_of_a_child_after_a_collection("plain")
    shared = private_bytes_of_a_child_after_a_collection("freeze")
    assert copied > 12 * 2**20, f"the collection copied only {copied / 2**20:.1f} MiB: the test sees nothing"
    assert shared < copied / 4, f"{shared / 2**20:.1f} MiB private after the freeze, {copied / 2**20:.1f} without"
