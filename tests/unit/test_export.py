"""`peer export` in this process, on checkpoints written here (peer/cli/export.py, peer/runtime/export.py): what it
writes, and every refusal in one line with exit code 2. After a real peer's run: tests/swarm/test_export.py."""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Tuple

import pytest
import safetensors.torch
import torch

from peer.checkpoint.store import CheckpointStore
from peer.cli.main import main
from peer.runtime.trainer import seed_from_run_id
from tests.tasks_for_tests import TiedLM
from tests.unit.test_checkpoint_format import earlier_format_file

pytestmark = pytest.mark.timeout(120)

TIED = "tests.tasks_for_tests:make_tied_task"
RUN_ID = "export-run"


def trained_weights() -> dict:
    """TiedLM's weights, moved away from its seeded start so that an export of the fresh model cannot pass."""
    torch.manual_seed(seed_from_run_id(RUN_ID))
    model = TiedLM()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
        model.norm.running_mean.add_(1.0)
    return model.state_dict()


def write_checkpoint(directory: Path, epoch: int = 3, **changes) -> Path:
    state = {"model": trained_weights(), "optimizer": {"state": {}, "param_groups": []}, "run_id": RUN_ID,
             "task": "tied", "task_spec": TIED, "task_options": {}, **changes}
    return CheckpointStore(directory).save(state, global_epoch=epoch)


def export(capsys, *args: str) -> Tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(["export", *args])
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def test_export_writes_every_weight_as_safetensors_and_describes_it(tmp_path, capsys):
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "exported"

    code, stdout, stderr = export(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out))

    assert code == 0, stderr
    assert stdout == (f"exported {checkpoint.name} (task tied, run {RUN_ID}, global epoch 3) to {out}: "
                      f"model.json, model.safetensors\n")
    expected = trained_weights()
    tensors = safetensors.torch.load_file(out / "model.safetensors")  # a reader that knows nothing of ties
    assert sorted(tensors) == sorted(expected)
    for name, tensor in expected.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
    model = TiedLM()
    model.load_state_dict(tensors)

    description = json.loads((out / "model.json").read_text())
    data = (out / "model.safetensors").read_bytes()
    assert description == {
        "format": "swarmtrain-export",
        "version": 1,
        "swarmtrain_version": description["swarmtrain_version"],
        "task": TIED,
        "task_name": "tied",
        "task_options": {},
        "run_id": RUN_ID,
        "global_epoch": 3,
        "checkpoint": {"path": str(checkpoint),
                       "sha256": hashlib.sha256((checkpoint / "checkpoint.json").read_bytes()).hexdigest()},
        "weights": {"file": "model.safetensors", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
        "parameter_count": 13 * 6 + 6 + 6,  # the tied weight once, and the norm's weight and bias
        "tensors": {name: {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                           "kind": "buffer" if name.startswith("norm.") and "running" in name
                           or name.endswith("num_batches_tracked") else "parameter"}
                    for name, tensor in expected.items()},
        "tied": [["embed.weight", "head.weight"]],
    }
    assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []  # no temp directory beside


def test_a_task_with_its_own_exporter_writes_its_form(tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt", task_spec="tests.tasks_for_tests:make_self_exporting_task")
    code, _, stderr = export(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"))
    assert code == 0, stderr
    assert os.listdir(tmp_path / "out") == ["weights.txt"]
    lines = (tmp_path / "out" / "weights.txt").read_text().splitlines()
    assert lines[0] == f"embed.weight {float(trained_weights()['embed.weight'].double().sum())!r}"


def test_a_checkpoint_of_the_earlier_format_exports(tmp_path, capsys):
    # it recorded only the task's own name: a built-in's is its --task; this task's name is its --task here
    (tmp_path / "ckpt").mkdir()
    earlier_format_file(tmp_path / "ckpt", 4, 2, {"model": trained_weights(), "run_id": RUN_ID, "task": TIED})
    code, stdout, stderr = export(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"))
    assert code == 0, stderr
    assert "checkpoint-000004-epoch000002.pt" in stdout and "global epoch 2" in stdout
    tensors = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(tensors[name], tensor) for name, tensor in trained_weights().items())


def test_force_replaces_a_non_empty_out_and_an_empty_one_is_written_into(tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt")
    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.mkdir()
    full.mkdir()
    (full / "old.txt").write_text("replaced")

    assert export(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(empty))[0] == 0
    assert export(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(full), "--force")[0] == 0

    for out in (empty, full):
        assert sorted(os.listdir(out)) == ["model.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "empty", "full"]


def test_damaged_newer_checkpoints_are_skipped_and_named(tmp_path, capsys):
    older = write_checkpoint(tmp_path / "ckpt", epoch=3)
    newer = write_checkpoint(tmp_path / "ckpt", epoch=4)
    (newer / "model.safetensors").write_bytes(b"torn")

    code, stdout, stderr = export(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"))

    assert code == 0 and f"exported {older.name}" in stdout
    assert stderr.count("\n") == 1 and stderr.startswith("warning: ") and newer.name in stderr
    assert json.loads((tmp_path / "out" / "model.json").read_text())["global_epoch"] == 3


def test_the_checkpoint_dir_is_only_read(tmp_path, capsys):
    """A running peer's directory: its lock, its write in progress and its files stay as they were."""
    directory = tmp_path / "ckpt"
    write_checkpoint(directory)
    in_progress = directory / ".checkpoint-checkpoint-000002-epoch000004.12345678.tmp"
    in_progress.mkdir()
    (in_progress / "model.safetensors").write_bytes(b"being written")
    before = {path: path.stat().st_mtime_ns for path in directory.rglob("*")}

    assert export(capsys, "--checkpoint-dir", str(directory), "--out", str(tmp_path / "out"))[0] == 0

    assert {path: path.stat().st_mtime_ns for path in directory.rglob("*")} == before
    assert not (directory / "peer.lock").exists()


def damage_every_checkpoint(tmp_path: Path) -> Tuple[list, str]:
    first, second = write_checkpoint(tmp_path / "ckpt", epoch=1), write_checkpoint(tmp_path / "ckpt", epoch=2)
    (first / "training.pt").write_bytes(b"")
    (second / "checkpoint.json").unlink()
    return [str(tmp_path / "ckpt")], rf"holds no readable checkpoint, every one is damaged \({second.name}: .*; " \
                                     rf"{first.name}: .*\)"


def unbuildable_task(tmp_path: Path) -> Tuple[list, str]:
    write_checkpoint(tmp_path / "ckpt", task_spec="tests.no_such_module:make_task")
    return [str(tmp_path / "ckpt")], (r"--checkpoint-dir: the task tests.no_such_module:make_task of checkpoint "
                                      r"checkpoint-000001-epoch000003 cannot be built here: --task: cannot import "
                                      r"module 'tests.no_such_module'")


REFUSALS = {  # name -> builds the case in tmp_path: (the --checkpoint-dir args, a regex the one line must match)
    "missing_dir": lambda t: ([str(t / "nowhere")], r"--checkpoint-dir .*nowhere does not exist"),
    "empty_dir": lambda t: ((t / "ckpt").mkdir() or [str(t / "ckpt")], r"--checkpoint-dir .*ckpt holds no checkpoint"),
    "all_damaged": damage_every_checkpoint,
    "unbuildable_task": unbuildable_task,
    "not_a_peer_checkpoint": lambda t: (
        CheckpointStore(t / "ckpt").save({"model": {"w": torch.ones(2)}}, 1) and [str(t / "ckpt")],
        r"checkpoint-000001-epoch000001 records no task and model weights"),
    "weights_that_do_not_fit": lambda t: (
        write_checkpoint(t / "ckpt", task_spec="tests.tasks_for_tests:make_slow_data_task") and [str(t / "ckpt")],
        r"the weights of checkpoint checkpoint-000001-epoch000003 do not fit the model "
        r"tests.tasks_for_tests:make_slow_data_task builds here \(.*\); export with the task code that wrote it"),
    "unknown_task_options": lambda t: (
        write_checkpoint(t / "ckpt", task_options={"layers_of_cake": 3}) and [str(t / "ckpt")],
        r"records task options this swarmtrain .* does not take \(layers_of_cake: Extra inputs are not permitted\)"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, case):
    checkpoint_dir, pattern = REFUSALS[case](tmp_path)
    out = tmp_path / "out"
    code, stdout, stderr = export(capsys, "--checkpoint-dir", *checkpoint_dir, "--out", str(out))
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: ") and stdout == "", stderr
    assert re.search(pattern, stderr), stderr
    assert "Traceback" not in stderr and not out.exists()
    assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []


@pytest.mark.parametrize("force", [False, True])
def test_an_out_that_may_not_be_written_is_refused(tmp_path, capsys, force):
    write_checkpoint(tmp_path / "ckpt")
    full, a_file = tmp_path / "full", tmp_path / "a-file"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    a_file.write_text("mine")
    cases = [(a_file, "exists and is not a directory"), (tmp_path, "holds --checkpoint-dir")]
    if not force:
        cases.append((full, "exists and is not empty; name a new or empty directory, or add --force to replace it"))
    for out, reason in cases:
        code, _, stderr = export(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out),
                                 *(["--force"] if force else []))
        assert code == 2 and stderr.count("\n") == 1 and f"--out {out} {reason}" in stderr, stderr
    assert (full / "keep.txt").read_text() == "mine" and a_file.read_text() == "mine"


def test_a_missing_out_flag_exits_2_with_one_line(tmp_path, capsys):
    code, _, stderr = export(capsys, "--checkpoint-dir", str(tmp_path))
    assert code == 2 and stderr.count("\n") == 1 and "--out" in stderr, stderr


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_export_leaves_nothing_half_written(tmp_path, capsys, existing):
    write_checkpoint(tmp_path / "ckpt", task_spec="tests.tasks_for_tests:make_failing_export_task")
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "keep.txt").write_text("the export before")

    code, _, stderr = export(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out),
                             *(["--force"] if existing else []))

    assert code == 1 and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"error: cannot write --out {out}: ") and "failing in export_model" in stderr
    assert stderr.rstrip().endswith("nothing was written there")
    assert (os.listdir(out) == ["keep.txt"]) if existing else not out.exists()
    assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []


def test_an_hf_causal_lm_checkpoint_exports_what_from_pretrained_loads(tmp_path, capsys):
    """Tied embeddings through the whole path: the checkpoint stores them once, the export's from_pretrained
    directory gives the same logits as the model whose weights the checkpoint holds."""
    transformers = pytest.importorskip("transformers")
    from peer.tasks import load_task
    from peer.tasks.options import TaskOptions

    transformers.LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
                             ).save_pretrained(tmp_path / "config")
    options = TaskOptions(model=str(tmp_path / "config"))
    task = load_task("hf-causal-lm", options=options)
    torch.manual_seed(seed_from_run_id(RUN_ID))
    model = task.build_model()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    state = {"model": model.state_dict(), "run_id": RUN_ID, "task": task.name, "task_spec": "hf-causal-lm",
             "task_options": options.model_dump(mode="json")}
    checkpoint = CheckpointStore(tmp_path / "ckpt").save(state, global_epoch=5)
    assert json.loads((checkpoint / "checkpoint.json").read_text())["model"]["tied"] == {
        "lm_head.weight": "model.embed_tokens.weight"}

    code, _, stderr = export(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"))

    assert code == 0, stderr
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(exported(tokens).logits, model.eval()(tokens).logits, atol=1e-5, rtol=0)


def test_an_hf_causal_lm_configuration_changed_since_the_checkpoint_is_refused(tmp_path, capsys):
    """A config.json edited after training in a way no tensor shape shows (the rotary base) would be exported as
    the model's configuration: export compares the digests the checkpoint recorded and refuses in one line."""
    transformers = pytest.importorskip("transformers")
    from peer.tasks import load_task
    from peer.tasks.options import TaskOptions

    settings = dict(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2)
    transformers.LlamaConfig(**settings).save_pretrained(tmp_path / "config")
    options = TaskOptions(model=str(tmp_path / "config"))
    task = load_task("hf-causal-lm", options=options)
    torch.manual_seed(seed_from_run_id(RUN_ID))
    state = {"model": task.build_model().state_dict(), "run_id": RUN_ID, "task": task.name,
             "task_spec": "hf-causal-lm", "task_options": options.model_dump(mode="json"),
             "task_digests": dict(task.shared_digests)}
    CheckpointStore(tmp_path / "ckpt").save(state, global_epoch=3)
    transformers.LlamaConfig(**settings, rope_theta=500.0).save_pretrained(tmp_path / "config")

    code, _, stderr = export(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"))

    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "model_config (digest" in stderr and "changed since it was written" in stderr
    assert not (tmp_path / "out").exists()
