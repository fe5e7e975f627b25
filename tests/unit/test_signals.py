"""Ctrl+C and SIGTERM (peer/process/signals.py): the first asks the peer to stop, the second exits at once, and
neither can freeze the peer, whatever the main thread holds when the signal lands."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from peer.exit_codes import ExitCode
from peer.process.signals import StopRequest
from tests.peers import REPO_ROOT


@pytest.fixture
def stop():
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    request = StopRequest()
    request.install_handlers()
    yield request
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_a_signal_asks_to_stop_and_names_itself(stop):
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.wait(10)
    assert stop.signal_name == "SIGTERM"


def test_a_signal_that_lands_while_the_main_thread_holds_the_stop_lock_still_stops_the_peer(stop):
    # Python runs a handler in the main thread between two bytecodes, inside whatever it holds: here the lock that
    # Event.wait holds while it checks the flag. A handler that set the Event itself would wait for it for ever.
    with stop._event._cond:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler runs in here
        assert not stop
    assert stop.wait(10)
    assert stop.signal_name == "SIGINT"


@pytest.mark.timeout(60)
def test_a_second_signal_exits_at_once_with_its_own_code():
    script = textwrap.dedent("""
        import sys, time
        from peer.process.signals import StopRequest
        stop = StopRequest()
        stop.install_handlers()
        print("ready", flush=True)
        while True:  # a peer that does not get round to stopping
            time.sleep(0.1)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert process.poll() is None  # the first one only asked
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == ExitCode.SECOND_SIGNAL
        stderr = process.stderr.read()
        assert "SIGINT received" in stderr and "second SIGINT: exiting now" in stderr, stderr
    finally:
        process.kill()
        process.wait(timeout=30)
