"""The bad input matrix: every flag and config key, wrong in every way a person gets it wrong.

Each case must end in exit code 2 with one line naming the input, and never a traceback
or a hang. Config problems are checked in-process (fast); problems that only show when
the peer starts (a busy port, a broken task module) run the real command.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

import pytest

from peer.cli.main import main
from peer.config import OPTIONS_BY_CLI
from tests.peers import REPO_ROOT

PEER_ID = "12D3KooWFpVSw4FTShHPfXTgjf5fjiiBtY2NdFq4fZDS5FgUFc9S"  # any valid one: initial peers must name theirs


def _file(tmp: Path, name: str, content: str) -> str:
    path = tmp / name
    path.write_text(content)
    return str(path)


def _fifo(tmp: Path, name: str) -> str:
    """A named pipe with no writer: opening it would block forever."""
    path = tmp / name
    os.mkfifo(path)
    return str(path)


# command-line name (OPTIONS_BY_CLI) -> functions of a temp dir returning a bad value for it
BAD_VALUES: Dict[str, List[Callable[[Path], str]]] = {
    "run_id": [lambda t: "has space", lambda t: "dots.are.not.allowed", lambda t: "r" * 100_000],
    "task": [lambda t: ""],
    "task_timeout_seconds": [lambda t: "0", lambda t: "nan"],
    "batch_size": [lambda t: "0", lambda t: "eight"],
    "device": [lambda t: "tpu", lambda t: "cuda:x"],
    "precision": [lambda t: "fp8"],
    "max_epochs": [lambda t: "0", lambda t: "1.5"],
    "max_seconds": [lambda t: "-1", lambda t: "soon", lambda t: "inf"],
    "data_workers": [lambda t: "-1"],
    "seed": [lambda t: "-1", lambda t: str(2**80)],
    "val_batches": [lambda t: "0"],
    "checkpoint_dir": [lambda t: _file(t, "a-file", "not a directory")],
    "checkpoint_every_epochs": [lambda t: "0"],
    "keep_checkpoints": [lambda t: "0"],
    "log_format": [lambda t: "xml"],
    "verbose": [lambda t: "maybe"],
    "summary_json": [lambda t: str(t)],
    "events": [lambda t: str(t)],
    "initial_peers": [lambda t: "not-a-multiaddr", lambda t: "/ip4/999.1.1.1/tcp/1",
                      lambda t: "/ip4/127.0.0.1/tcp/40749"],  # no /p2p/ part: nobody to dial
    "initial_peers_file": [lambda t: str(t / "missing.txt"), lambda t: _file(t, "peers.txt", "garbage\n"),
                           lambda t: _fifo(t, "peers.txt"), lambda t: _file(t, "big.txt", "#" * (2 << 20))],
    "identity": [lambda t: _file(t, "identity.key", "not a key")],
    "swarm_key": [lambda t: _file(t, "swarm.key", "short"), lambda t: str(t / "missing.key"), lambda t: "/dev/zero",
                  lambda t: _fifo(t, "swarm.key")],
    "run_owner": [lambda t: "not-hex", lambda t: "0123456789ABCDEF" * 2, lambda t: "ab" * 15],
    "host_maddrs": [lambda t: "0.0.0.0:31337"],
    "announce_maddrs": [lambda t: "/ip4/1.2.3.4/tcp/port", lambda t: "/ip4/1.2.3.4/tcp/0"],
    "client_mode": [lambda t: "perhaps"],
    "startup_timeout_seconds": [lambda t: "0"],
    "startup_attempts": [lambda t: "0"],
    "target_batch_size": [lambda t: "0", lambda t: "lots"],
    "matchmaking_seconds": [lambda t: "-1", lambda t: "later"],
    "averaging_timeout_seconds": [lambda t: "0"],
    "load_state_timeout_seconds": [lambda t: "0"],
    "min_peers": [lambda t: "0"],
    "min_peers_timeout_seconds": [lambda t: "0"],
    "metrics_port": [lambda t: "70000", lambda t: "on"],
    "metrics_host": [lambda t: "not a host!"],
    "health_window_seconds": [lambda t: "0"],
    "averaging": [lambda t: "gossip"],
    "matchmaking_seconds_min": [lambda t: "0"],
    "matchmaking_seconds_max": [lambda t: "-3"],
    "averaging_timeout_seconds_min": [lambda t: "0"],
    "averaging_timeout_seconds_max": [lambda t: "never"],
    "average_state_every": [lambda t: "0"],
    "average_opt_statistics": [lambda t: "exp avg"],
    "powersgd_rank": [lambda t: "0"],
    "diloco_inner_steps": [lambda t: "0"],
    "diloco_overlap": [lambda t: "sometimes"],
    "outer_lr": [lambda t: "0", lambda t: "inf"],
    "outer_momentum": [lambda t: "1.5", lambda t: "nan"],
    "target_group_size": [lambda t: "1", lambda t: "four"],
    "max_upload_mbit": [lambda t: "0", lambda t: "-5", lambda t: "nan", lambda t: "inf", lambda t: "fast"],
    "max_round_factor": [lambda t: "0", lambda t: "1.5", lambda t: "65", lambda t: "long"],
    "grad_compression": [lambda t: "zip"],
    "state_compression": [lambda t: "fp8"],
    "load_state_compression": [lambda t: "gzip"],
    "adaptive_compression_threshold": [lambda t: "0"],
    "topk_fraction": [lambda t: "0", lambda t: "1.5"],
    "topk_value_bits": [lambda t: "3", lambda t: "eight", lambda t: "32"],
    "topk_chunk": [lambda t: "100", lambda t: "8", lambda t: "131072", lambda t: "many"],
    "adaptive_large_codec": [lambda t: "fp16"],
    "error_feedback": [lambda t: "always"],
    "offload_optimizer": [lambda t: "sometimes"],
    "delay_updates": [lambda t: "yes please"],
    "robust_aggregation": [lambda t: "median"],
    "robust_max_weight_share": [lambda t: "0.5", lambda t: "inf"],
    "robust_norm_ratio": [lambda t: "1"],
    "robust_min_cosine": [lambda t: "-2"],
    "robust_trim_fraction": [lambda t: "0.5"],
    "exclude_after": [lambda t: "0"],
    "exclude_window": [lambda t: "0"],
    "exclusion_seconds": [lambda t: "-5"],
    "harmful_update_rise": [lambda t: "-0.1", lambda t: "often"],
    "harmful_updates": [lambda t: "0"],
    "harmful_update_window": [lambda t: "0"],
    "straggler_grace_ratio": [lambda t: "-1", lambda t: "soon"],
    "straggler_grace_min_seconds": [lambda t: "0"],
    "active_hours": [lambda t: "9-17", lambda t: "Mon-Fry 18:00-20:00", lambda t: "22:00-07:00,"],
    "yield_when_busy": [lambda t: "when-idle"],
    "yield_cpu_share": [lambda t: "0", lambda t: "1.5"],
    "yield_gpu_share": [lambda t: "-0.1"],
    "yield_after_seconds": [lambda t: "-1"],
    "resume_after_quiet_seconds": [lambda t: "soon"],
    # hf-causal-lm's options: paths that must exist here (a Hub name never does: nothing is downloaded)
    "model_config": [lambda t: "meta-llama/Llama-3.2-1B", lambda t: str(t / "missing" / "config.json")],
    "init_from": [lambda t: str(t / "no-such-dir")],
    "data": [lambda t: str(t / "nothing-*.txt"), lambda t: _file(t, "notes.pdf", "not text it reads")],
    "tokenizer": [lambda t: "gpt2"],
    "seq_len": [lambda t: "1", lambda t: "long"],
}

CASES = [(name, index) for name in sorted(BAD_VALUES) for index in range(len(BAD_VALUES[name]))]
# a boolean flag takes no value: its bad values come through the environment or a config file
FLAG_CASES = [(name, index) for name, index in CASES if not OPTIONS_BY_CLI[name].is_bool]


@pytest.fixture(autouse=True)
def never_start_a_peer(monkeypatch):
    """If a bad value were accepted, fail at once instead of training in the test process."""
    import peer.cli.start

    def accepted(config, faults=None):
        raise AssertionError("the bad input was accepted")

    monkeypatch.setattr(peer.cli.start, "run_peer", accepted)


def run_cli(capsys, argv: List[str]) -> tuple:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    return exited.value.code, captured.out + captured.err


def assert_one_line_error(code, output: str, *must_contain: str) -> None:
    assert code == 2, output
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert lines[0].startswith("error: ") and "Traceback" not in output
    for text in must_contain:
        assert text in lines[0], output


def test_every_option_is_in_the_matrix():
    assert sorted(OPTIONS_BY_CLI) == sorted(BAD_VALUES)


@pytest.mark.parametrize("name, index", FLAG_CASES)
def test_bad_flag(capsys, tmp_path, name, index):
    option = OPTIONS_BY_CLI[name]
    code, output = run_cli(capsys, ["start", option.flag, BAD_VALUES[name][index](tmp_path)])
    assert_one_line_error(code, output, option.flag)


@pytest.mark.parametrize("name, index", CASES)
def test_bad_environment_variable(capsys, tmp_path, monkeypatch, name, index):
    option = OPTIONS_BY_CLI[name]
    monkeypatch.setenv(option.env, BAD_VALUES[name][index](tmp_path))
    code, output = run_cli(capsys, ["start"])
    assert_one_line_error(code, output, option.flag, option.env)


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_bad_config_file_value(capsys, tmp_path, name):
    option = OPTIONS_BY_CLI[name]
    value = BAD_VALUES[name][0](tmp_path)
    config = tmp_path / "peer.toml"
    config.write_text(f"[{option.section}]\n{option.name} = {value!r}\n".replace("'", '"'))
    code, output = run_cli(capsys, ["start", "--config", str(config)])
    assert_one_line_error(code, output, option.dotted, str(config))


@pytest.mark.parametrize(
    "content, expected, name",
    [
        ("[training]\nbatch_sise = 4\n", "unknown key 'training.batch_sise' (did you mean 'training.batch_size'?)",
         "peer.toml"),
        ("[trainig]\nbatch_size = 4\n", "unknown key 'trainig' (did you mean 'training'?)", "peer.toml"),
        ("batch_size = 4\n", "unknown key 'batch_size' (did you mean 'training.batch_size'?)", "peer.toml"),
        ("[training]\nbatch_size = 4\nbatch_size = 5\n", "is not valid TOML", "peer.toml"),
        ("[training]\nbatch_size = 'four'\n", "--batch-size (training.batch_size) = 'four'", "peer.toml"),
        ("training = 3\n", "[training] must be a table", "peer.toml"),
        ("[averaging]\ntarget_batch_size = true\n", "a boolean where a number belongs", "peer.toml"),
        ("[monitoring]\nmetrics_port = 1.0\n", "must be a whole number", "peer.toml"),
        ("[averaging]\nouter_lr = inf\n", "--outer-lr (averaging.outer_lr) = inf", "peer.toml"),
        (b"\x00\xff\xfe garbage \x89PNG", "is not a text file", "peer.toml"),
        ("training:\n  batch_size: 4\n  batch_size: 8\n", "duplicate key 'batch_size'", "peer.yaml"),
        ('a: &a ["x","x","x"]\nb: &b [*a,*a,*a]\nc: [*b,*b,*b]\n', "aliases (*name) are not allowed", "peer.yaml"),
        (b"\x00\xff\xfe garbage", "is not a text file", "peer.yaml"),
    ],
)
def test_bad_config_file_shape(capsys, tmp_path, content, expected, name):
    config = tmp_path / name
    config.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, output = run_cli(capsys, ["start", "--config", str(config)])
    assert_one_line_error(code, output, expected)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--config", "{tmp}/missing.toml"], "--config: cannot read"),
        (["--config", "{tmp}"], "--config"),
        (["--config", "{tmp}/peer.ini"], "must end in .toml, .yaml or .yml"),
        (["--config", "{tmp}/fifo.toml"], "--config: {tmp}/fifo.toml is not a regular file (a FIFO, device or socket)"),
        (["--batch-size", "64", "--target-batch-size", "32"],
         "--batch-size (64) is larger than --target-batch-size (32)"),
        (["--client-mode"], "--client-mode needs --initial-peers"),
        (["--batchsize", "4"], "--batchsize"),
        (["--max-epochs"], "--max-epochs"),
        (["--delay-updates"], "--delay-updates"),
        (["--averaging", "diloco", "--offload-optimizer"], "--offload-optimizer does not work with --averaging diloco"),
        (["--matchmaking-seconds-min", "9", "--matchmaking-seconds-max", "3"], "--matchmaking-seconds-min"),
        (["--grad-compression", "int3"], "--grad-compression"),
        (["--diloco-overlap"], "--diloco-overlap needs --averaging diloco (got sync"),
        (["--max-upload-mbit", "10"],
         "--max-upload-mbit 10 needs --averaging diloco (got sync: only diloco reads it); add --averaging diloco or "
         "drop --max-upload-mbit"),
        (["--averaging", "local-sgd", "--max-upload-mbit", "2.5"], "--max-upload-mbit 2.5 needs --averaging diloco"),
        (["--target-group-size", "4"],
         "--target-group-size 4 needs --averaging local-sgd (got sync: only local-sgd reads it); add --averaging "
         "local-sgd or drop --target-group-size"),
        (["--error-feedback", "on"], "--error-feedback on needs --grad-compression int8, int4 or topk (got none"),
        (["--error-feedback", "on", "--grad-compression", "uint8"], "error feedback is built for the codecs here"),
        (["--error-feedback", "on", "--grad-compression", "int8", "--averaging", "powersgd"],
         "--error-feedback on does not apply to --averaging powersgd"),
        (["--model-config", "llama-1m"],
         "--model-config: an option of --task hf-causal-lm, which --task bytelm does not take"),
        (["--task", "examples.custom_task:make_task", "--seq-len", "64"],
         "--seq-len: an option of --task hf-causal-lm, which --task examples.custom_task:make_task does not take"),
        (["--task", "hf-causal-lm"], "--task hf-causal-lm needs --data"),
        (["--inject-faults", "{{not json"], "--inject-faults"),
        (["--inject-faults", '{{"fail_round_at_epoch": -1}}'], "fail_round_at_epoch: Input should be greater than"),
        (["--inject-faults", '{{"crash": true}}'], "crash: Extra inputs are not permitted"),
    ],
)
def test_unreadable_files_conflicts_and_unknown_flags(capsys, tmp_path, argv, expected):
    (tmp_path / "peer.ini").write_text("[training]\n")
    os.mkfifo(tmp_path / "fifo.toml")  # opening it would block for ever: it must be refused from its stat
    code, output = run_cli(capsys, ["start", *[arg.format(tmp=tmp_path) for arg in argv]])
    assert_one_line_error(code, output, expected.format(tmp=tmp_path))


def test_unknown_environment_variable_suggests_the_right_one(capsys, monkeypatch):
    monkeypatch.setenv("PEER_TARGET_BATCHSIZE", "64")
    code, output = run_cli(capsys, ["start"])
    assert_one_line_error(code, output, "PEER_TARGET_BATCHSIZE", "did you mean 'PEER_TARGET_BATCH_SIZE'?")


def run_peer_process(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer", "start", "--checkpoint-dir", str(tmp_path / "ckpt"), *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT)},
    )


@pytest.mark.parametrize(
    "module_source, task, expected",
    [
        (None, "bytelmm", "did you mean 'bytelm'"),
        (None, "no_such_module_anywhere:make_task", "cannot import module 'no_such_module_anywhere'"),
        (None, "examples/custom_task.py", "not as a file path; give --task examples.custom_task:make_task"),
        ("raise RuntimeError('broken on import')\n", "broken_task:make_task", "RuntimeError: broken on import"),
        ("def make_task():\n    return 42\n", "broken_task:make_task", "returned int, expected peer.tasks.Task"),
        ("import sys\ndef make_task():\n    sys.exit(0)\n", "broken_task:make_task", "called sys.exit(0) instead"),
        ("import sys\nsys.exit(3)\n", "broken_task:make_task", "importing 'broken_task' called sys.exit(3)"),
        ("import time\ntime.sleep(3600)\n", "broken_task:make_task", "took longer than --task-timeout-seconds 8"),
        ("import dataclasses, time\nfrom peer.tasks import load_task\nclass Hangs:\n    def __len__(self):\n"
         "        return 1000\n    def __getitem__(self, index):\n        time.sleep(3600)\ndef make_task():\n"
         "    return dataclasses.replace(load_task('bytelm-tiny'), build_train_dataset=Hangs)\n",
         "broken_task:make_task", "reading its first batch and computing its loss took longer than"),
        ("import dataclasses\nfrom peer.tasks import load_task\ndef make_task():\n"
         "    return dataclasses.replace(load_task('bytelm-tiny'), build_train_dataset=lambda: [])\n",
         "broken_task:make_task", "build_train_dataset() holds 0 samples, fewer than one batch"),
    ],
)
def test_bad_task_exits_2_without_traceback(tmp_path, module_source, task, expected):
    if module_source is not None:
        (tmp_path / "broken_task.py").write_text(module_source)
    # the rows that hang wait the timeout out; the others get one that suite load cannot reach
    timeout = "8" if "took longer than" in expected else "60"
    result = run_peer_process(tmp_path, "--task", task, "--metrics-port", "0", "--task-timeout-seconds", timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert expected in output and "Traceback" not in output
    assert [line for line in output.splitlines() if line.startswith("error: ")] == [
        line for line in output.splitlines() if expected in line
    ]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--average-opt-statistics", "nonexistent_stat"],
         "--average-opt-statistics nonexistent_stat: not in the state of AdamW"),
        (["--metrics-host", "8.8.8.8"], "--metrics-host 8.8.8.8 is not an address of this machine"),
        (["--host-maddrs", "/ip4/8.8.8.8/tcp/0"], "8.8.8.8 is not an address of this machine"),
        (["--checkpoint-dir", "{tmp}/a-file/ckpt"], "--checkpoint-dir {tmp}/a-file/ckpt is not a directory this peer"),
        (["--summary-json", "{tmp}/a-file/summary.json"], "--summary-json: the directory of {tmp}/a-file is not"),
        (["--events", "{tmp}/a-file/events.jsonl"], "--events: the directory of {tmp}/a-file is not"),
        (["--events", "{tmp}/a-fifo"], "--events {tmp}/a-fifo exists and is not a regular file"),
        (["--device", "cuda:7"], "--device cuda:7: "),  # no GPU here, or no GPU 7 on a machine with a few
    ],
)
def test_problems_found_at_start_are_bad_input_named_before_joining(tmp_path, args, expected):
    (tmp_path / "a-file").write_text("a regular file, where a directory is needed")
    os.mkfifo(tmp_path / "a-fifo")
    result = run_peer_process(tmp_path, "--task", "bytelm-tiny", "--metrics-port", "0",
                              *[arg.format(tmp=tmp_path) for arg in args])
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert expected.format(tmp=tmp_path) in output and "Traceback" not in output
    assert "peer id" not in output  # found before the DHT started


def test_metrics_port_in_use_exits_2(tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_peer_process(tmp_path, "--task", "bytelm-tiny", "--metrics-port", str(port))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert f"metrics port {port} on 127.0.0.1 is already in use" in output and "Traceback" not in output


@pytest.mark.parametrize("command", ["status", "monitor"])
def test_status_and_monitor_take_and_check_the_swarm_key(capsys, tmp_path, command):
    """Both read a keyed swarm's progress, so both take --swarm-key, checked like peer start's."""
    code, output = run_cli(capsys, [command, "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}", "--swarm-key",
                                    str(tmp_path / "missing.key")])
    assert_one_line_error(code, output, "--swarm-key", "missing.key")


@pytest.mark.parametrize("stage", ["scheduler", "first_step"])
def test_a_crash_at_any_stage_of_start_up_ends_the_process_with_one_line(tmp_path, stage):
    """The subprocess timeout is the bound: a peer that hangs after its crash fails the test."""
    result = subprocess.run(
        [sys.executable, "-m", "peer", "start", "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-port", "0",
         "--task", "tests.tasks_for_tests:make_failing_task", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
        capture_output=True, text=True, timeout=90, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "FAIL_AT": stage},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert output.count(f"peer failed: StageFailure: failing at {stage}") == 1 and "Traceback" not in output, output
    assert "peer stopped (crashed)" in output


def test_the_fault_injection_option_is_hidden_from_help(capsys):
    code, output = run_cli(capsys, ["start", "--help"])
    assert code == 0 and "--max-epochs" in output and "inject" not in output
