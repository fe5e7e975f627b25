"""Device and precision choice, checked against the machine: what exists is named when the choice is wrong.

A machine with GPUs is simulated where needed (torch.cuda's queries patched), so that these run the same on a
CPU-only CI machine and on a GPU one."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from peer.cli.main import main
from peer.cli.swarm import choose_gpus, peer_args
from peer.config import load_config
from peer.runtime.device import DeviceUnavailable, resolve_device, resolve_precision
from peer.runtime.precision import MixedPrecision


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def two_gpus(monkeypatch):
    """Two fake GPUs; `bf16` in the returned dict says whether they support it. Records set_device calls."""
    fake = {"bf16": True, "current": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: fake["current"].append(index))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: fake["bf16"])
    return fake


def test_auto_and_cpu_resolve_to_the_cpu_without_a_gpu(no_gpu):
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("requested", ["cuda", "cuda:7"])
def test_a_gpu_on_a_machine_without_one_is_refused(no_gpu, requested):
    with pytest.raises(DeviceUnavailable, match=f"--device {requested}: this machine has no CUDA device .* use "
                                                f"--device cpu or auto"):
        resolve_device(requested)


def test_a_gpu_index_that_does_not_exist_names_the_ones_that_do(two_gpus):
    with pytest.raises(DeviceUnavailable) as error:
        resolve_device("cuda:7")
    assert str(error.value) == ("--device cuda:7: there is no GPU 7; this machine has cuda:0 (Fake GPU), "
                                "cuda:1 (Fake GPU)")


def test_a_chosen_gpu_becomes_the_current_one(two_gpus):
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert two_gpus["current"] == [1, 0]  # so that the GPU memory gauges and a task's "cuda" mean this GPU


@pytest.mark.parametrize("requested, expected", [("auto", "fp32"), ("fp32", "fp32"), ("bf16", "bf16")])
def test_precision_on_the_cpu(requested, expected):
    assert resolve_precision(requested, torch.device("cpu")) == expected


def test_fp16_on_the_cpu_is_refused_with_the_alternatives():
    with pytest.raises(DeviceUnavailable, match="--precision fp16 needs a CUDA device .* use --precision bf16 or fp32"):
        resolve_precision("fp16", torch.device("cpu"))


def test_auto_precision_on_a_gpu_is_bf16_where_supported(two_gpus):
    gpu = torch.device("cuda", 0)
    assert resolve_precision("auto", gpu) == "bf16" and resolve_precision("fp16", gpu) == "fp16"
    two_gpus["bf16"] = False
    assert resolve_precision("auto", gpu) == "fp32"
    with pytest.raises(DeviceUnavailable, match="--precision bf16: Fake GPU does not support bf16; use --precision "
                                                "fp16 or fp32"):
        resolve_precision("bf16", gpu)


def test_bf16_autocast_computes_in_bf16_and_keeps_weights_and_gradients_fp32():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    precision = MixedPrecision("bf16", torch.device("cpu"), model.parameters())
    with precision.autocast():
        output = model(torch.randn(3, 4))
    precision.backward(output.float().pow(2).mean())
    assert output.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert precision.scale == 1.0 and precision.state_dict() == {}  # no loss scaling outside fp16


# --- peer swarm --gpus ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, expected", [("all", [0, 1]), ("1", [1]), ("1,0", [1, 0])])
def test_gpus_choose_one_peer_per_gpu(spec, expected):
    assert choose_gpus(spec, gpu_count=2) == expected


@pytest.mark.parametrize("spec, count, message", [
    ("all", 0, "--gpus all: this machine has no CUDA device that torch can use; leave out --gpus"),
    ("0,1", 0, "--gpus 0,1: this machine has no CUDA device"),
    ("2", 2, "--gpus 2: no GPU 2; this machine has GPUs 0 to 1"),
    ("0,0", 2, "--gpus 0,0: a GPU is listed twice"),
    ("first", 2, "--gpus 'first': give 'all' or GPU indices separated by commas"),
])
def test_bad_gpus_are_named(spec, count, message):
    with pytest.raises(ValueError, match=message):
        choose_gpus(spec, gpu_count=count)


def test_each_peer_of_a_gpu_swarm_gets_its_gpu(tmp_path: Path):
    config = load_config(flags={"checkpoint_dir": tmp_path})
    args = [peer_args(config, [], index, None, gpus=[2, 5]) for index in range(2)]
    assert [a[a.index("--device") + 1] for a in args] == ["cuda:2", "cuda:5"]
    assert "--device" not in peer_args(config, [], 0, None)


def run_cli(capsys, argv):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    return exited.value.code, (captured.out + captured.err).strip().splitlines()


def test_peer_swarm_gpus_without_a_gpu_exits_2_with_one_line(capsys, no_gpu):
    code, lines = run_cli(capsys, ["swarm", "--gpus", "all"])
    assert code == 2 and lines == ["error: --gpus all: this machine has no CUDA device that torch can use; leave "
                                   "out --gpus to run the peers on the CPU"]


@pytest.mark.parametrize("extra, message", [
    (["--peers", "3"], "--peers 3 conflicts with --gpus all (2 GPU(s), one peer each); leave out --peers"),
    (["--device", "cuda:0"], "--gpus all sets each peer's --device; leave out --device"),
])
def test_peer_swarm_gpus_conflicts_exit_2(capsys, two_gpus, extra, message):
    code, lines = run_cli(capsys, ["swarm", "--gpus", "all", *extra])
    assert code == 2 and lines == [f"error: {message}"]
