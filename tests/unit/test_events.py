"""The events file (peer/telemetry/events.py): one whole JSON object per line, whatever happens to the writer."""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from peer.telemetry.events import (
    SCHEMA_VERSION,
    EpochEnded,
    EventLog,
    Exited,
    Ready,
    RoundEnded,
    parse_line,
    read_events,
)


def test_events_round_trip_with_their_version_and_kind(tmp_path: Path):
    log = EventLog(tmp_path / "events.jsonl")
    written = [
        Ready(peer_id="12D3KooW", run_id="run", multiaddrs=["/ip4/127.0.0.1/tcp/1/p2p/12D3KooW"]),
        EpochEnded(epoch=3, train_loss=2.5, val_loss=2.4, samples=64, seconds=2.0, samples_per_second=32.0,
                   swarm_samples_per_second=96.0, peers=3),
        Exited(reason="max_epochs", code=0),
    ]
    for event in written:
        log.emit(event)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["ready", "epoch", "exit"]
    assert all(json.loads(line)["v"] == SCHEMA_VERSION for line in lines)
    events, offset = read_events(tmp_path / "events.jsonl")
    assert events == written and offset == (tmp_path / "events.jsonl").stat().st_size


def test_a_line_still_being_written_is_left_for_the_next_read(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    EventLog(path).emit(RoundEnded(outcome="ok", seconds=0.5, group_size=2))
    whole = path.read_bytes()
    half = Exited(reason="max_epochs", code=0).model_dump_json().encode()
    path.write_bytes(whole + half[:10])
    events, offset = read_events(path)
    assert [event.event for event in events] == ["round"] and offset == len(whole)
    path.write_bytes(whole + half + b"\n")
    events, offset = read_events(path, offset)
    assert [event.event for event in events] == ["exit"] and offset == len(whole + half) + 1


def test_a_kind_from_a_newer_peer_is_skipped_and_a_malformed_line_is_an_error(tmp_path: Path):
    assert parse_line(json.dumps({"v": 2, "event": "teleported", "time": 1.0})) is None
    with pytest.raises(ValueError, match="outcome"):
        parse_line(json.dumps({"v": 1, "event": "round", "time": 1.0}))
    assert read_events(tmp_path / "missing.jsonl", 7) == ([], 7)  # not written yet


def test_lines_from_many_threads_never_interleave(tmp_path: Path):
    log, path = EventLog(tmp_path / "events.jsonl"), tmp_path / "events.jsonl"

    def write(thread: int) -> None:
        for index in range(200):
            log.emit(RoundEnded(outcome="ok", seconds=float(index), group_size=thread, reason="x" * 500))

    threads = [threading.Thread(target=write, args=(thread,)) for thread in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    events, _ = read_events(path)
    assert len(events) == 800
    assert sorted(event.group_size for event in events) == sorted([0, 1, 2, 3] * 200)


def test_a_file_that_cannot_be_written_is_said_once_and_never_raises(tmp_path: Path, caplog):
    log = EventLog(tmp_path / "missing-directory" / "events.jsonl")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            log.emit(Exited(reason="max_epochs", code=0))
    warnings = [record.getMessage() for record in caplog.records if "cannot write" in record.getMessage()]
    assert len(warnings) == 1 and "missing-directory" in warnings[0]
    EventLog(None).emit(Exited(reason="max_epochs", code=0))  # no --events: nothing happens


def test_a_harness_peer_sees_only_the_events_of_its_own_lives(tmp_path: Path):
    from peer.testing import Peer

    earlier = EventLog(tmp_path / "a.events.jsonl")
    earlier.emit(Ready(peer_id="old", run_id="run", multiaddrs=["/ip4/127.0.0.1/tcp/1/p2p/old"]))
    peer = Peer("a", "start", [], tmp_path)  # the same workdir, used again: the old ready is not its own
    assert peer.events == [] and peer.epoch == -1
    earlier.emit(Exited(reason="max_epochs", code=0))
    assert [event.event for event in peer.events] == ["exit"]
