"""PeerConfig: precedence, one-pass validation, and the CLI's exit code 2 for bad input."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from pydantic import BaseModel, ConfigDict, Field

import peer.config
from peer.cli.main import main
from peer.config import OPTIONS, OPTIONS_BY_CLI, ConfigError, PeerConfig, index_options, load_config
from tests.peers import REPO_ROOT

PEER_ID = "12D3KooWFpVSw4FTShHPfXTgjf5fjiiBtY2NdFq4fZDS5FgUFc9S"  # any valid one: initial peers must name theirs


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    captured = capsys.readouterr()
    return exited.value.code, captured.err


def test_defaults_are_valid_and_lone_peer_trains_at_once():
    config = load_config()
    assert config.averaging.min_peers == 1
    assert config.training.task == "bytelm"
    assert config.dht.initial_peers == []
    assert config.monitoring.metrics_host == "127.0.0.1"  # this machine only, unless an operator opens it


def test_precedence_defaults_file_env_flags(tmp_path: Path):
    config_file = tmp_path / "peer.toml"
    config_file.write_text(
        "[training]\nbatch_size = 8\nrun_id = 'from-file'\nmax_epochs = 5\n"
        "[averaging]\ntarget_batch_size = 512\nmatchmaking_seconds = 2.5\n"
    )
    env = {"PEER_BATCH_SIZE": "16", "PEER_RUN_ID": "from-env"}
    flags = {"batch_size": "32"}
    config = load_config(config_file, env, flags)
    assert config.training.batch_size == 32  # flag beats env and file
    assert config.training.run_id == "from-env"  # env beats file
    assert config.training.max_epochs == 5  # file beats default
    assert config.averaging.matchmaking_seconds == 2.5
    assert config.averaging.averaging_timeout_seconds == PeerConfig().averaging.averaging_timeout_seconds


def test_yaml_file_and_comma_separated_initial_peers(tmp_path: Path):
    config_file = tmp_path / "peer.yaml"
    config_file.write_text(f"dht:\n  initial_peers:\n    - /ip4/10.0.0.1/tcp/31337/p2p/{PEER_ID}\n")
    assert load_config(config_file).dht.initial_peers == [f"/ip4/10.0.0.1/tcp/31337/p2p/{PEER_ID}"]
    env = {"PEER_INITIAL_PEERS": f"/ip4/10.0.0.1/tcp/1/p2p/{PEER_ID}, /dns4/bootstrap/tcp/2/p2p/{PEER_ID}"}
    assert load_config(environ=env).dht.initial_peers == [f"/ip4/10.0.0.1/tcp/1/p2p/{PEER_ID}",
                                                          f"/dns4/bootstrap/tcp/2/p2p/{PEER_ID}"]


def test_every_problem_reported_in_one_pass(tmp_path: Path):
    config_file = tmp_path / "peer.toml"
    config_file.write_text("[training]\nbatch_sise = 3\n[averging]\nx = 1\n")
    with pytest.raises(ConfigError) as error:
        load_config(
            config_file,
            {"PEER_DEVICE": "gpu", "PEER_BATCHSIZE": "3"},
            {"matchmaking_seconds": "soon", "initial_peers": "not-a-multiaddr"},
        )
    problems = error.value.problems
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    assert "unknown key 'training.batch_sise' (did you mean 'training.batch_size'?)" in text
    assert "unknown key 'averging' (did you mean 'averaging'?)" in text
    assert "PEER_BATCHSIZE: unknown environment variable (did you mean 'PEER_BATCH_SIZE'?)" in text
    assert "--device (training.device) = 'gpu' from env PEER_DEVICE" in text
    assert "--matchmaking-seconds (averaging.matchmaking_seconds) = 'soon' from flag --matchmaking-seconds" in text
    assert "malformed multiaddr 'not-a-multiaddr'" in text
    assert all("\n" not in problem for problem in problems)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            {"batch_size": "0"},
            "--batch-size (training.batch_size) = '0' from flag --batch-size: "
            "Input should be greater than or equal to 1",
        ),
        ({"target_batch_size": "-5"}, "--target-batch-size"),
        ({"max_epochs": "1.5"}, "--max-epochs"),
        ({"metrics_port": "70000"}, "--metrics-port"),
        ({"log_format": "xml"}, "--log-format"),
        ({"run_id": "has space"}, "--run-id"),
        ({"averaging_timeout_seconds": "0"}, "--averaging-timeout-seconds"),
        ({"batch_size": "64", "target_batch_size": "32"}, "--batch-size (64) is larger than --target-batch-size (32)"),
        ({"client_mode": True}, "--client-mode needs --initial-peers"),
        (
            {"robust_max_weight_share": "0.5"},
            "--robust-max-weight-share (averaging.robust_max_weight_share) = '0.5' from flag "
            "--robust-max-weight-share: Input should be greater than or equal to 1",
        ),
    ],
)
def test_bad_values_name_the_flag(flags, expected):
    with pytest.raises(ConfigError) as error:
        load_config(flags=flags)
    assert expected in str(error.value)


def test_every_option_has_help_and_a_unique_flag():
    flags = [option.flag for option in OPTIONS.values()]
    assert len(flags) == len(set(flags))
    assert all(option.help for option in OPTIONS.values())
    for required in ["--run-id", "--task", "--initial-peers", "--host-maddrs", "--announce-maddrs",
                     "--target-batch-size", "--batch-size", "--device", "--max-epochs", "--max-seconds",
                     "--checkpoint-dir", "--checkpoint-every-epochs", "--metrics-port", "--summary-json",
                     "--log-format", "--verbose", "--matchmaking-seconds", "--averaging-timeout-seconds"]:
        assert required in flags


def test_options_are_keyed_by_section_and_field():
    assert OPTIONS["training.batch_size"] is OPTIONS_BY_CLI["batch_size"]
    assert OPTIONS["averaging.strategy"] is OPTIONS_BY_CLI["averaging"]
    assert "strategy" not in OPTIONS_BY_CLI


class _Fetch(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    timeout_seconds: float = Field(default=1.0, gt=0, json_schema_extra={"cli_name": "fetch_timeout_seconds"})


class _Upload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    timeout_seconds: float = Field(default=2.0, gt=0, json_schema_extra={"cli_name": "upload_timeout_seconds"})


class _TwoSections(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    fetch: _Fetch = _Fetch()
    upload: _Upload = _Upload()


def test_two_sections_may_share_a_field_name(tmp_path: Path, monkeypatch):
    sections = {"fetch": _Fetch, "upload": _Upload}
    options, by_cli, by_env = index_options(sections)
    assert sorted(options) == ["fetch.timeout_seconds", "upload.timeout_seconds"]
    assert by_cli["upload_timeout_seconds"].dotted == "upload.timeout_seconds"
    assert by_env["PEER_FETCH_TIMEOUT_SECONDS"].dotted == "fetch.timeout_seconds"
    # load_config reads the module's schema and indexes; swap in the two-section ones
    for name, value in [("SECTIONS", sections), ("OPTIONS", options), ("OPTIONS_BY_CLI", by_cli),
                        ("OPTIONS_BY_ENV", by_env), ("PeerConfig", _TwoSections)]:
        monkeypatch.setattr(peer.config, name, value)

    config_file = tmp_path / "peer.toml"
    config_file.write_text("[fetch]\ntimeout_seconds = 3\n[upload]\ntimeout_seconds = 4\n")
    config = load_config(config_file)
    assert (config.fetch.timeout_seconds, config.upload.timeout_seconds) == (3, 4)
    config = load_config(config_file, {"PEER_FETCH_TIMEOUT_SECONDS": "5"}, {"upload_timeout_seconds": "6"})
    assert (config.fetch.timeout_seconds, config.upload.timeout_seconds) == (5, 6)
    with pytest.raises(ConfigError) as error:
        load_config(config_file, flags={"upload_timeout_seconds": "0"})
    assert error.value.problems == [
        "--upload-timeout-seconds (upload.timeout_seconds) = '0' from flag --upload-timeout-seconds: "
        "Input should be greater than 0; fix --upload-timeout-seconds"
    ]


def test_two_options_with_one_cli_name_are_refused_naming_both():
    """Checked before each insert: naming both options means neither was dropped by an overwrite."""
    class Clash(BaseModel):
        timeout_seconds: float = Field(default=1.0, json_schema_extra={"cli_name": "fetch_timeout_seconds"})

    with pytest.raises(ValueError) as error:
        index_options({"fetch": _Fetch, "clash": Clash})
    message = str(error.value)
    assert (
        "fetch.timeout_seconds and clash.timeout_seconds share the command-line name 'fetch_timeout_seconds'"
        in message
    )

    class Plain(BaseModel):  # no cli_name: the field name is the flag, as in a second section that forgot one
        timeout_seconds: float = 1.0

    with pytest.raises(ValueError) as error:
        index_options({"fetch": Plain, "upload": Plain})
    assert "fetch.timeout_seconds and upload.timeout_seconds share the command-line name 'timeout_seconds'" in str(
        error.value)


def test_cli_exits_2_with_one_line_per_problem(capsys, monkeypatch):
    monkeypatch.setenv("PEER_DEVICE", "tpu")
    code, err = run_cli(capsys, "start", "--batch-size", "-1", "--metrics-port", "x")
    lines = err.strip().splitlines()
    assert code == 2
    assert len(lines) == 3, err
    assert all(line.startswith("error: ") for line in lines)
    assert "Traceback" not in err


def test_cli_unknown_flag_is_one_line(capsys):
    code, err = run_cli(capsys, "start", "--batchsize", "3")
    assert code == 2
    assert err.strip().count("\n") == 0 and "--batchsize" in err and "--batch-size" in err


def test_cli_missing_config_file(capsys, tmp_path: Path):
    code, err = run_cli(capsys, "start", "--config", str(tmp_path / "missing.toml"))
    assert code == 2
    assert f"--config: cannot read {tmp_path / 'missing.toml'}" in err


def test_installed_entry_point_reports_bad_input_without_traceback():
    """The real console entry (python -m peer) for a bad task: exit 2, one line, no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "peer", "start", "--task", "bytelmm", "--metrics-port", "0"],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert "did you mean 'bytelm'" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_the_entry_point_exits_without_teardown_yet_loses_no_output_and_keeps_its_code(tmp_path):
    """peer/cli/entry.py ends the process from its last exit handler: what was printed (a pipe's buffer, the logging
    module's), the exit code, and the other exit handlers' work (multiprocessing's) must all survive that."""
    script = tmp_path / "exits.py"
    script.write_text(  # a stand-in for peer.cli.main, whose imports register their exit handlers after entry.py's
        "import sys, types\n"
        "def main(argv=None):\n"
        "    import atexit, logging, multiprocessing, time\n"
        "    atexit.register(lambda: print('a later exit handler ran', flush=False))\n"
        "    child = multiprocessing.get_context('fork').Process(target=time.sleep, args=(0.5,), daemon=False)\n"
        "    child.start()  # joined by multiprocessing's own exit handler, before the process ends\n"
        "    print(f'child {child.pid}', flush=False)\n"
        "    logging.basicConfig(stream=sys.stderr)\n"
        "    logging.getLogger('x').warning('logged last')\n"
        "    sys.exit(3)\n"
        "sys.modules['peer.cli.main'] = types.SimpleNamespace(main=main)\n"
        "from peer.cli import entry\n"
        "entry.run()\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 3, result.stderr
    assert "a later exit handler ran" in result.stdout and "logged last" in result.stderr, result
    child_pid = int(result.stdout.split("child ")[1].split()[0])
    assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE


def test_only_the_peer_that_started_the_run_prints_how_to_join_it_with_its_owner():
    from peer.cli.start import join_hint

    lan, loopback = f"/ip4/192.168.1.5/tcp/40123/p2p/{PEER_ID}", f"/ip4/127.0.0.1/tcp/40123/p2p/{PEER_ID}"
    owner = "0123456789abcdef" * 2
    starter = load_config(flags={"task": "bytelm-tiny"})
    hint = join_hint(starter, [lan, loopback], owner)
    assert hint.startswith("To join this swarm from another machine, run:")
    assert (f"peer start --run-id swarmtrain --run-owner {owner} --task bytelm-tiny --target-batch-size 4096 "
            f"--initial-peers {lan}") in hint
    # listening on the loopback only (as `peer swarm` does): another machine could not use that address
    hint = join_hint(starter, [loopback], owner)
    assert hint.startswith("To join this swarm from this machine, run:") and "--host-maddrs /ip4/0.0.0.0/" in hint
    # a joiner knew an address already (`peer swarm` prints one hint), even one that started with --initial-peers
    assert join_hint(load_config(flags={"initial_peers": lan}), [lan], None) is None
    assert join_hint(load_config(flags={"initial_peers": lan, "client_mode": "true"}), [lan], owner) is None
