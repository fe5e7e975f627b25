"""DHTConfig: --initial-peers-file and --identity are checked at config load, with one-line errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from dht.identity import ensure_identity
from peer.cli.main import main
from peer.config import ConfigError, load_config

PEER_ID = "QmZurcthsZnDEsqwnnY67QJW6mAXMS3VayxHZMFQ6QHNKX"


def problems_of(**kwargs) -> list:
    with pytest.raises(ConfigError) as error:
        load_config(**kwargs)
    assert all("\n" not in problem for problem in error.value.problems)
    return error.value.problems


def test_peers_file_comments_blank_lines_and_merge_with_flag(tmp_path: Path):
    peers_file = tmp_path / "peers.txt"
    peers_file.write_text(
        "# bootstrap nodes of the run\n\n"
        f"/ip4/203.0.113.7/tcp/31337/p2p/{PEER_ID}   # the lab's node\n"
        f"   /dns4/bootstrap.example.org/tcp/31337/p2p/{PEER_ID}\n"
        f"/ip4/10.0.0.1/tcp/1/p2p/{PEER_ID}\n"
    )
    config = load_config(flags={"initial_peers": f"/ip4/10.0.0.1/tcp/1/p2p/{PEER_ID}",
                                "initial_peers_file": str(peers_file)})
    assert config.dht.initial_peers == [
        f"/ip4/10.0.0.1/tcp/1/p2p/{PEER_ID}",  # from the flag first; the file's duplicate is dropped
        f"/ip4/203.0.113.7/tcp/31337/p2p/{PEER_ID}",
        f"/dns4/bootstrap.example.org/tcp/31337/p2p/{PEER_ID}",
    ]
    assert config.dht.initial_peers_file == peers_file


def test_peers_file_from_env_satisfies_client_mode(tmp_path: Path):
    peers_file = tmp_path / "peers.txt"
    peers_file.write_text(f"/dns4/bootstrap.example.org/tcp/31337/p2p/{PEER_ID}\n")
    config = load_config(environ={"PEER_INITIAL_PEERS_FILE": str(peers_file), "PEER_CLIENT_MODE": "true"})
    assert config.dht.client_mode
    assert config.dht.initial_peers == [f"/dns4/bootstrap.example.org/tcp/31337/p2p/{PEER_ID}"]


def test_malformed_line_names_file_and_line(tmp_path: Path):
    peers_file = tmp_path / "peers.txt"
    peers_file.write_text(f"# ok\n/ip4/10.0.0.1/tcp/1/p2p/{PEER_ID}\n10.0.0.2:31337\n")
    [problem] = problems_of(flags={"initial_peers_file": str(peers_file)})
    assert problem.startswith("--initial-peers-file (dht.initial_peers_file)")
    assert f"{peers_file} line 3: malformed multiaddr '10.0.0.2:31337'" in problem


@pytest.mark.parametrize("content", [None, "", "# only a comment\n\n"])
def test_missing_or_empty_peers_file_is_an_error(tmp_path: Path, content):
    peers_file = tmp_path / "peers.txt"
    if content is not None:
        peers_file.write_text(content)
    [problem] = problems_of(environ={"PEER_INITIAL_PEERS_FILE": str(peers_file)})
    assert str(peers_file) in problem and "PEER_INITIAL_PEERS_FILE" in problem
    assert ("cannot read" in problem) if content is None else ("lists no multiaddrs" in problem)


def test_unreadable_peers_file(tmp_path: Path):
    peers_file = tmp_path / "peers.d"
    peers_file.mkdir()  # unreadable as a file even for root, unlike a chmod 0 file
    [problem] = problems_of(flags={"initial_peers_file": str(peers_file)})
    assert f"{peers_file} is a directory; give the path of a file" in problem


def test_corrupt_identity_is_reported_at_load_and_left_untouched(tmp_path: Path):
    key = tmp_path / "identity.key"
    key.write_bytes(b"not a key at all")
    before = key.stat()
    [problem] = problems_of(flags={"identity": str(key)})
    assert problem.startswith("--identity (dht.identity)")
    assert f"identity file {key} is not a valid private key" in problem
    assert key.read_bytes() == b"not a key at all" and key.stat().st_mtime_ns == before.st_mtime_ns


def test_identity_checks_and_config_load_writes_nothing(tmp_path: Path):
    missing = tmp_path / "new.key"
    assert load_config(flags={"identity": str(missing)}).dht.identity == missing
    assert not missing.exists()  # created when the DHT starts, not at load
    [problem] = problems_of(flags={"identity": str(tmp_path / "no-such-dir" / "x.key")})
    assert "does not exist" in problem
    valid = tmp_path / "valid.key"
    peer_id = ensure_identity(valid)
    assert load_config(flags={"identity": str(valid)}).dht.identity == valid
    assert ensure_identity(valid) == peer_id  # an existing key is read, never regenerated


def test_cli_reports_dht_problems_together_exit_2(tmp_path: Path, capsys):
    peers_file = tmp_path / "peers.txt"
    peers_file.write_text("nonsense\n")
    key = tmp_path / "bad.key"
    key.write_bytes(b"\x00" * 10)
    with pytest.raises(SystemExit) as exited:
        main(["bootstrap", "--initial-peers-file", str(peers_file), "--identity", str(key)])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert all(line.startswith("error: ") for line in lines)
    assert "line 1: malformed multiaddr 'nonsense'" in err and f"identity file {key}" in err


def test_bootstrap_refuses_client_mode(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bootstrap", "--client-mode", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}"])
    assert exited.value.code == 2
    assert "--client-mode" in capsys.readouterr().err


def test_status_needs_initial_peers(capsys, monkeypatch):
    monkeypatch.delenv("PEER_INITIAL_PEERS", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["status"])
    assert exited.value.code == 2
    assert "--initial-peers" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["flag", "file"])
def test_an_initial_peer_without_its_peer_id_is_refused_with_the_fix(tmp_path: Path, where):
    address = "/ip4/127.0.0.1/tcp/40749"  # hivemind cannot dial it: it retries, then blames the peer
    peers_file = tmp_path / "peers.txt"
    peers_file.write_text(address + "\n")
    flags = {"initial_peers": address} if where == "flag" else {"initial_peers_file": str(peers_file)}
    [problem] = problems_of(flags=flags)
    assert f"{address} has no /p2p/<peer id> part" in problem
    assert "'join from another machine' line" in problem
