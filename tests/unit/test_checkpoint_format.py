"""The checkpoint's formats: weights in safetensors with ties and strides handled, each part checked, the
earlier single-file format still read and ordered with the new one (peer/checkpoint/parts.py, weights.py, store.py).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import safetensors.torch
import torch

from peer.checkpoint.store import CheckpointStore, read_newest
from tests.unit.test_checkpoint import assert_nested_equal, small_state, warnings_about

pytestmark = pytest.mark.timeout(120)


class TiedLM(torch.nn.Module):
    """Embedding and output layer share one weight, as a Llama with tie_word_embeddings does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.norm = torch.nn.BatchNorm1d(4)  # buffers, and a module version that load_state_dict reads
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_are_stored_once_and_tied_again_on_load(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    state = {"model": model.state_dict(), "task": "tied"}
    path = CheckpointStore(tmp_path).save(state, global_epoch=1)

    on_disk = safetensors.torch.load_file(path / "model.safetensors")
    assert "head.weight" not in on_disk and torch.equal(on_disk["embed.weight"], model.embed.weight)
    index = json.loads((path / "checkpoint.json").read_text())
    assert index["model"]["tied"] == {"head.weight": "embed.weight"}

    loaded = CheckpointStore(tmp_path).load_latest().state
    assert_nested_equal(loaded, state)
    weights = loaded["model"]
    assert weights["head.weight"].data_ptr() == weights["embed.weight"].data_ptr()
    restored = TiedLM()
    restored.load_state_dict(weights)  # strict: every name is there
    assert restored.head.weight is restored.embed.weight
    assert torch.equal(restored.head.weight, model.head.weight)


def test_non_contiguous_and_overlapping_tensors_are_saved_as_their_values(tmp_path):
    buffer = torch.arange(24, dtype=torch.float32)
    model_state = OrderedDict([
        ("transposed", torch.randn(3, 5).t()),
        ("every_other", torch.randn(10)[::2]),
        ("broadcast", torch.ones(3).expand(4, 3)),
        ("first_half", buffer[:12].view(3, 4)),  # two views of one buffer that are not the same tensor
        ("whole", buffer.view(4, 6)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 3)),
        ("steps", torch.tensor(7, dtype=torch.int64)),
        ("half", torch.randn(2, 2, dtype=torch.bfloat16)),
    ])
    assert not model_state["transposed"].is_contiguous()
    state = {"model": model_state}

    CheckpointStore(tmp_path).save(state, global_epoch=1)

    assert_nested_equal(CheckpointStore(tmp_path).load_latest().state, state)


def test_a_transformers_llama_with_tied_embeddings_round_trips(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    weights = model.state_dict()
    assert weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()

    CheckpointStore(tmp_path).save({"model": weights}, global_epoch=1)
    loaded = CheckpointStore(tmp_path).load_latest().state["model"]

    assert_nested_equal(loaded, weights)
    restored = transformers.LlamaForCausalLM(config)
    restored.load_state_dict(loaded)
    tokens = torch.arange(10).unsqueeze(0)
    assert torch.equal(restored(tokens).logits, model(tokens).logits)


@pytest.mark.parametrize("model_state", [
    OrderedDict([("w", torch.ones(2)), ("_extra_state", {"step": 3})]),  # a module's extra state, any object
    {"w": torch.zeros(2, dtype=torch.complex128)},  # a dtype safetensors has no code for
], ids=["extra_state", "complex128"])
def test_a_model_safetensors_cannot_hold_stays_with_the_training_state(tmp_path, model_state):
    state = {"model": model_state, "step": 1}
    path = CheckpointStore(tmp_path).save(state, global_epoch=1)
    assert sorted(os.listdir(path)) == ["checkpoint.json", "training.pt"]
    assert json.loads((path / "checkpoint.json").read_text())["model"] is None
    assert_nested_equal(CheckpointStore(tmp_path).load_latest().state, state)


def save_two(tmp_path):
    store = CheckpointStore(tmp_path)
    return store, store.save(small_state(1), global_epoch=1), store.save(small_state(2), global_epoch=2)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01
    path.write_bytes(bytes(data))


def append(path: Path) -> None:
    with open(path, "ab") as file:
        file.write(b"\0" * 8)


def edit_a_digest(path: Path) -> None:
    index = json.loads(path.read_text())
    index["files"]["training.pt"]["sha256"] = "0" * 64
    path.write_text(json.dumps(index))


def edit_the_layout(path: Path) -> None:
    """A change that leaves valid JSON and every part's digest as it was: only the index's own sha256 sees it."""
    text = path.read_text()
    edited = text.replace('"ordered": false', '"ordered": true') if '"ordered": false' in text else \
        text.replace('"ordered": true', '"ordered": false')
    assert edited != text
    path.write_text(edited)


DAMAGE = {  # (part, damage, what the warning says)
    "model_truncated": ("model.safetensors", truncate, "truncated"),
    "model_flipped": ("model.safetensors", flip_a_byte, "sha256 of model.safetensors"),
    "model_longer": ("model.safetensors", append, "longer than"),
    "model_missing": ("model.safetensors", Path.unlink, "No such file"),
    "training_truncated": ("training.pt", truncate, "truncated"),
    "training_flipped": ("training.pt", flip_a_byte, "sha256 of training.pt"),
    "training_missing": ("training.pt", Path.unlink, "No such file"),
    "index_missing": ("checkpoint.json", Path.unlink, "No such file"),
    "index_truncated": ("checkpoint.json", truncate, "not JSON"),
    "index_digest_edited": ("checkpoint.json", edit_a_digest, "sha256 of checkpoint.json"),
    "index_layout_edited": ("checkpoint.json", edit_the_layout, "sha256 of checkpoint.json"),
    "index_flipped": ("checkpoint.json", flip_a_byte, "checkpoint.json"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_to_any_part_is_detected_and_the_previous_checkpoint_used(tmp_path, caplog, damage):
    part, spoil, reason = DAMAGE[damage]
    store, first, second = save_two(tmp_path)
    spoil(second / part)

    with caplog.at_level(logging.WARNING, logger="peer.checkpoint.store"):
        loaded = store.load_latest()

    assert loaded.path == first
    assert_nested_equal(loaded.state, small_state(1))
    messages = warnings_about(caplog, second)
    assert len(messages) == 1 and reason in messages[0], messages
    assert second.exists(), "a damaged checkpoint is left in place for inspection"


def earlier_format_file(directory: Path, sequence: int, epoch: int, state: dict) -> Path:
    """A checkpoint as the single-file format wrote it, built here from its documented layout."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path = directory / f"checkpoint-{sequence:06d}-epoch{epoch:06d}.pt"
    path.write_bytes(struct.pack("<8sIQ32s", b"SWRMCKPT", 1, len(payload), hashlib.sha256(payload).digest()) + payload)
    return path


def test_a_checkpoint_of_the_earlier_format_loads(tmp_path):
    model = TiedLM()
    state = {"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}, "run_id": "r"}
    path = earlier_format_file(tmp_path, 1, 4, state)
    loaded = CheckpointStore(tmp_path).load_latest()
    assert loaded.path == path and loaded.global_epoch == 4
    assert loaded.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert_nested_equal(loaded.state, state)
    TiedLM().load_state_dict(loaded.state["model"])


def test_both_formats_are_one_sequence_for_ordering_loading_and_pruning(tmp_path, caplog):
    old_first = earlier_format_file(tmp_path, 1, 1, small_state(1))
    old_second = earlier_format_file(tmp_path, 2, 2, small_state(2))
    store = CheckpointStore(tmp_path, keep=3)
    assert store.list() == [old_first, old_second]

    new = store.save(small_state(3), global_epoch=3)
    assert new.name == "checkpoint-000003-epoch000003"  # the sequence goes on from the earlier files
    assert store.list() == [old_first, old_second, new]
    assert store.load_latest().path == new

    (new / "model.safetensors").unlink()  # damaged: the newest intact one is of the earlier format
    with caplog.at_level(logging.WARNING, logger="peer.checkpoint.store"):
        loaded = store.load_latest()
    assert loaded.path == old_second and warnings_about(caplog, new)
    assert_nested_equal(loaded.state, small_state(2))

    newer = store.save(small_state(4), global_epoch=4)  # keep=3: the oldest earlier-format file goes
    assert store.list() == [old_second, new, newer] and not old_first.exists()
    newest_old = earlier_format_file(tmp_path, 9, 9, small_state(9))  # a later sequence wins, whatever its format
    assert store.load_latest().path == newest_old
    truncate(newest_old)  # a damaged file of the earlier format is still found out, and the next newest used
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="peer.checkpoint.store"):
        assert store.load_latest().path == newer
    assert warnings_about(caplog, newest_old)
    earlier_format_file(tmp_path, 9, 9, small_state(9))  # whole again
    store.save(small_state(10), global_epoch=10)
    assert [p.name for p in store.list()] == [newer.name, newest_old.name, "checkpoint-000010-epoch000010"]


def test_read_newest_only_reads_and_names_the_damaged(tmp_path):
    store, first, second = save_two(tmp_path)
    (second / "training.pt").write_bytes(b"garbage")
    in_progress = tmp_path / ".checkpoint-checkpoint-000003-epoch000003.0badc0de.tmp"
    in_progress.mkdir()  # a running peer's write, which a reader must leave alone
    before = sorted(os.listdir(tmp_path))

    loaded, damaged = read_newest(tmp_path)

    assert loaded.path == first and [d.path for d in damaged] == [second]
    assert "training.pt" in damaged[0].reason
    assert sorted(os.listdir(tmp_path)) == before
