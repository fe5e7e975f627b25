"""`--help` reads like a manual: flags by section, with what they take and their defaults; `--help-all` has the rest."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from averaging.registry import STRATEGY_NAMES
from peer.cli.main import cli
from peer.cli.options import SHOWN_ORDER, TUNING
from peer.config import OPTIONS_BY_CLI

SECTION = re.compile(r"^([A-Z][a-z ]+):$", re.M)


def help_of(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args], terminal_width=100)
    assert result.exit_code == 0, result.output
    return result.output


def test_start_help_lists_the_common_flags_by_section_with_choices_and_defaults():
    text = help_of("start", "--help")
    assert SECTION.findall(text) == ["Options", *SHOWN_ORDER]
    assert f"--averaging [{'|'.join(STRATEGY_NAMES)}]" in text  # the strategy registry's, in its order
    assert re.search(r"--matchmaking-seconds SECONDS\|auto\s+How long", text)
    assert re.search(r"--target-batch-size N\s+Samples the whole swarm .*\s+.*\[default: 4096\]", text)
    assert "--metrics-port PORT|off" in text and "[default: 127.0.0.1]" in text
    assert text.count("[env:") == 1 and "VALUE" not in text  # only --config says its variable here
    for option in OPTIONS_BY_CLI.values():  # each flag is listed here, or counted as one for --help-all
        listed = re.search(rf"^  {option.flag}[ /\n]", text, re.M) is not None
        assert listed == (option.cli_name not in TUNING), option.flag
    assert f"--help-all also lists {len(TUNING)} flags" in text
    assert len(text.splitlines()) < 140  # was 288 lines of one flat list at this width (127 before "Volunteer machine")


def test_help_all_gives_every_flag_its_description_variable_and_config_key():
    text = " ".join(help_of("start", "--help-all").split())  # unwrapped
    for option in OPTIONS_BY_CLI.values():
        assert option.flag in text
        assert f"[env: {option.env}; config: {option.dotted}]" in text, option.flag
    assert "--help-all also lists" not in text


@pytest.mark.parametrize("command", ["status", "monitor"])
def test_commands_that_read_a_swarm_describe_initial_peers_as_such(command):
    text = " ".join(help_of(command, "--help").split())
    assert "--initial-peers LIST Comma-separated multiaddrs of any peers or bootstrap nodes of the swarm" in text
    assert "empty starts a new swarm" not in text
    assert "empty starts a new swarm" in " ".join(help_of("start", "--help").split())


def test_help_and_the_local_swarm_launcher_run_without_torch():
    """torch (with hivemind) costs seconds of CPU to import: `peer --help` must not pay it, nor the launcher's
    modules (`peer swarm` imports torch itself, once it has set the threads of the CPU peers it forks), checked in a
    fresh interpreter: this one imported torch long ago."""
    check = ("import sys; from peer.cli.main import cli; import peer.cli.swarm, peer.testing; "
             "print(sorted(name for name in ('torch', 'hivemind') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize("flags, expected", [
    (["--metrics-host", "8.8.8.8"], "--metrics-host 8.8.8.8 is not an address of this machine"),
    (["--task", "bytelmm"], "did you mean 'bytelm'"),
])
def test_a_typo_in_a_path_an_address_or_the_task_name_is_refused_before_torch_is_imported(tmp_path, flags, expected):
    check = ("import sys; from peer.cli.main import main\n"
             "try:\n    main(sys.argv[1:])\n"
             "finally:\n    print(sorted(name for name in ('torch', 'hivemind') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", check, "start", "--checkpoint-dir", str(tmp_path / "ckpt"), *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "error: " in result.stderr and expected in result.stderr, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
