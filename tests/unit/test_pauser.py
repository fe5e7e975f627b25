"""The training loop pauses between whole steps and resumes (peer/runtime/pauser.py), with the fakes of test_trainer:
what the optimizer and the session are asked, and what the metrics, /healthz, the events and the state file say."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import List

from prometheus_client import CollectorRegistry

from monitoring import BottleneckClassifier, HealthCheck, PeerMetrics
from peer.runtime.pauser import Pauser
from peer.runtime.pausing import PAUSED, REQUESTED, STATE_FILE, TRAINING, PauseGate, read_json
from peer.telemetry.events import EventLog, Paused, Resumed, read_events
from peer.telemetry.observers import EventsObserver, MetricsObserver, Observers
from tests.unit.test_trainer import FakeSession, Rig, make_rig


class PausingSession(FakeSession):
    """FakeSession with the calls a pause makes; catch_up downloads, as when the swarm moved on meanwhile."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer, self.calls = optimizer, []

    def announce_paused(self) -> None:
        self.calls.append("announce_paused")

    def announce_resumed(self) -> None:
        self.calls.append("announce_resumed")

    def catch_up(self) -> None:
        self.calls.append("catch_up")
        self.optimizer.load_state_from_peers()


def pausable(rig: Rig, tmp_path: Path):
    """The rig's trainer with a pauser, reporting to the rig's observer, real metrics, health and events."""
    metrics, health = PeerMetrics(CollectorRegistry()), HealthCheck(60.0)
    events = tmp_path / "events.jsonl"
    observer = Observers(MetricsObserver(metrics, BottleneckClassifier(), health), EventsObserver(EventLog(events)),
                         rig.observer)  # last: what it records on a pause, the others have done
    gate, session = PauseGate(), PausingSession(rig.optimizer)
    rig.trainer.session = session
    rig.trainer.pauser = Pauser(gate, None, rig.config.checkpoint.checkpoint_dir, rig.model, rig.optimizer, session,
                                observer, rig.summary)
    return gate, session, metrics, health, events


def test_a_pause_stands_aside_after_a_whole_step_and_a_resume_catches_up(tmp_path):
    rig = make_rig(tmp_path, max_epochs=4)
    gate, session, metrics, health, events = pausable(rig, tmp_path)
    directory = rig.config.checkpoint.checkpoint_dir
    seen: List[tuple] = []
    rig.observer.after_step = lambda n: n == 3 and gate.hold(REQUESTED, "requested by peer pause")

    def on_paused(epoch, reasons, parked_bytes) -> None:  # what holds while it is paused
        metric = metrics.registry.get_sample_value("peer_paused", {"reason": REQUESTED})
        state = read_json(directory / STATE_FILE)
        seen.append((list(rig.optimizer.calls), list(session.calls), health(), metric, state))
        threading.Timer(0.3, gate.release, args=(REQUESTED,)).start()

    rig.observer.on_paused = on_paused
    assert rig.trainer.run() == "max_epochs"

    (calls, session_calls, (healthy, body), paused_metric, state), = seen
    assert calls[-1] == "pause" and session_calls == ["announce_paused"]
    assert healthy and body.startswith("paused: requested by peer pause") and paused_metric == 1
    assert state["state"] == PAUSED and state["reasons"] == {REQUESTED: "requested by peer pause"}
    assert len(rig.observer.steps) >= 3 and rig.optimizer.calls.count("pause") == 1
    after_pause = rig.optimizer.calls[rig.optimizer.calls.index("pause"):]
    assert after_pause[:3] == ["pause", "resume", "load_state_from_peers"]  # back, then the swarm's state
    assert session.calls == ["announce_paused", "announce_resumed", "catch_up"]
    kinds = [event for event in read_events(events)[0] if isinstance(event, (Paused, Resumed))]
    assert [type(event) for event in kinds] == [Paused, Resumed]
    # the event, the summary and the metric count the same pause
    assert kinds[1].downloaded and rig.summary.pauses == 1
    assert kinds[1].paused_seconds == round(rig.summary.paused_seconds, 3)
    assert metrics.registry.get_sample_value("peer_paused", {"reason": REQUESTED}) == 0
    assert metrics.registry.get_sample_value("peer_paused_seconds_total") == rig.summary.paused_seconds
    assert read_json(directory / STATE_FILE)["state"] == TRAINING and not health()[1].startswith("paused")


def test_a_stop_while_paused_ends_the_run_without_catching_up(tmp_path):
    rig = make_rig(tmp_path, max_epochs=100)
    gate, session, _, _, _ = pausable(rig, tmp_path)
    rig.observer.after_step = lambda n: n == 2 and gate.hold(REQUESTED, "requested by peer pause")
    rig.observer.on_paused = lambda *args: threading.Timer(0.2, rig.stop.set, args=("SIGTERM",)).start()
    assert rig.trainer.run() == "signal:SIGTERM"
    assert session.calls == ["announce_paused", "announce_resumed"] and "resume" in rig.optimizer.calls
