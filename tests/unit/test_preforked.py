"""Preforked peers (peer/process/preforked.py): a child forked before its command line is known runs it as `peer`
would, reports its exit code to its parent, and exits at once when discarded or when the parent dies.

Each case forks in a fresh Python process: a pytest worker runs threads of its own, and prefork() refuses to fork a
process that does (a fork copies only the calling thread). The parent imports nothing heavy first, which is only a cost
saving: what the children run imports what it needs.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import psutil

from peer.exit_codes import ExitCode
from tests.new_process import TIMEOUT_SECONDS, python_result

PRELUDE = """
import json, os, sys, time
from peer.cli.main import exit_code_of
from peer.process import preforked

def finish(process):
    \"\"\"Wait for a ForkedProcess to exit; all it printed.\"\"\"
    output = process.stdout.read()
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return output
"""


def run_parent(body: str) -> dict:
    """Run `body` in a new Python process after PRELUDE; the JSON it prints last."""
    return python_result(PRELUDE + textwrap.dedent(body))


def test_a_child_runs_its_command_line_with_its_environment_and_reports_the_exit_code():
    """The environment is the one launch() gives, not the parent's: here it carries a bad setting that the child's
    `peer start` refuses in one line, with exit code 2."""
    result = run_parent("""
        first, second = preforked.prefork(2, exit_code_of)
        os.environ.pop("PEER_TARGET_BATCH_SIZE", None)
        process = first.launch(["--version"], dict(os.environ))
        version = {"output": finish(process), "code": process.returncode}
        process = second.launch(["start"], {**os.environ, "PEER_TARGET_BATCH_SIZE": "0"})
        output = finish(process)
        print(json.dumps({"version": version, "code": process.returncode, "output": output}))
    """)
    assert result["version"]["code"] == 0 and result["version"]["output"].startswith("peer ")
    assert result["code"] == ExitCode.BAD_INPUT
    lines = result["output"].strip().splitlines()
    assert len(lines) == 1 and "PEER_TARGET_BATCH_SIZE" in lines[0] and "'0'" in lines[0], lines


def test_a_discarded_child_exits_without_running_anything_while_its_sibling_waits():
    """A sibling forked later holds no copy of the first child's command pipe, so discarding the first ends it."""
    result = run_parent("""
        first, second = preforked.prefork(2, exit_code_of)
        first.discard()
        discarded = first.process.poll()
        process = second.launch(["--version"], dict(os.environ))
        output = finish(process)
        print(json.dumps({"discarded": discarded, "code": process.returncode, "output": output}))
    """)
    assert result["discarded"] == 0
    assert result["code"] == 0 and result["output"].startswith("peer ")


def test_a_child_runs_one_command_only():
    result = run_parent("""
        (child,) = preforked.prefork(1, exit_code_of)
        process = child.launch(["--version"], dict(os.environ))
        try:
            child.launch(["--version"], dict(os.environ))
            error = None
        except RuntimeError as e:
            error = str(e)
        finish(process)
        print(json.dumps({"error": error}))
    """)
    assert result["error"] == "a preforked child runs one command: fork another"


def test_forking_refuses_a_process_that_runs_threads():
    result = run_parent("""
        import threading
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        try:
            preforked.prefork(1, exit_code_of)
            error = None
        except RuntimeError as e:
            error = str(e)
        print(json.dumps({"error": error}))
    """)
    assert result["error"] == "2 Python threads run: fork the peers before starting any"


def test_children_that_wait_for_their_command_die_with_their_parent():
    code = PRELUDE + textwrap.dedent("""
        children = preforked.prefork(2, exit_code_of)
        print(" ".join(str(child.process.pid) for child in children), flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2
        children = [psutil.Process(pid) for pid in pids]
        parent.send_signal(signal.SIGKILL)
        parent.wait(TIMEOUT_SECONDS)
        _, alive = psutil.wait_procs(children, timeout=TIMEOUT_SECONDS)
        assert not alive, f"still running after their parent was killed: {[child.pid for child in alive]}"
    finally:
        parent.kill()
        parent.wait(TIMEOUT_SECONDS)


def test_a_collected_child_is_not_signalled_again():
    result = run_parent("""
        (child,) = preforked.prefork(1, exit_code_of)
        process = child.launch(["--version"], dict(os.environ))
        finish(process)
        process.send_signal(9)  # its pid may be another process's by now: nothing is sent
        print(json.dumps({"code": process.returncode}))
    """)
    assert result["code"] == 0


def test_the_child_output_is_read_a_line_at_a_time():
    """Lines come through as they are written (line buffering), which `peer swarm` prefixes and prints live."""
    result = run_parent("""
        (child,) = preforked.prefork(1, exit_code_of)
        process = child.launch(["--help"], dict(os.environ))
        first_line = process.stdout.readline()
        rest = finish(process)
        print(json.dumps({"first": first_line, "code": process.returncode, "lines": len(rest.splitlines())}))
    """)
    assert result["code"] == 0 and result["first"].startswith("Usage: peer")
    assert result["lines"] > 5


def test_aforked_peer_has_hivemind_locks_of_its_own():
    """hivemind makes its result lock as it is imported. The parent here holds it for good, as a peer killed while
    holding it would. A child that shares it never gets a result from its own subprocess (the hazard, shown so that
    this test can fail); a child started as `peer swarm` starts its peers makes its own, and gets the result. The
    command line is how long to wait for it."""
    result = run_parent("""
        import functools
        import multiprocessing as mp
        from hivemind.utils.mpfuture import MPFuture
        from peer.cli.swarm import forked_peer

        def round_trip(argv):
            future = MPFuture()
            sender = mp.get_context("fork").Process(target=future.set_result, args=(42,), daemon=True)
            sender.start()
            try:
                return 0 if future.result(timeout=float(argv[0])) == 42 else 1
            except TimeoutError:
                return 3
            finally:
                sender.kill()
                sender.join(5)

        (sharing,) = preforked.prefork(1, round_trip)
        (own,) = preforked.prefork(1, functools.partial(forked_peer, round_trip))
        MPFuture._update_lock.acquire()
        codes = {}
        # the sharing child can never get its result: 5 s show it; the other one gets it as soon as it comes
        for name, child, wait in (("sharing", sharing, "5"), ("own", own, "60")):
            process = child.launch([wait], dict(os.environ))
            finish(process)
            codes[name] = process.returncode
        print(json.dumps(codes))
    """)
    assert result == {"sharing": 3, "own": 0}
