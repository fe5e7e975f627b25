"""The checkpoint directory: model weights in safetensors, the rest framed beside them, an index over both.

    checkpoint-<sequence>-epoch<global epoch>/
        model.safetensors   the "model" state_dict; safetensors, loadable by any tool (peer/checkpoint/weights.py)
        training.pt         the rest of the state (optimizer, scheduler, counters, run id, task...), framed
                            (peer/checkpoint/framed.py); its "model" entry is None when the weights are beside it
        checkpoint.json     the index, written last: the format, the global epoch, each part's length and sha256,
                            the model's layout (names in order, tied names, module versions), and the sha256 of
                            all that (of its JSON with sorted keys and no spaces), so the index is checked too

A state whose "model" is not a state_dict of tensors (or holds a dtype safetensors lacks) keeps it in
training.pt, and the index says so ("model": null). Each part is checked against the index on load, and the
index against the parts it must list, so a missing, truncated, corrupted or extra-long part is found.

This module writes into a directory it is given and reads one back; choosing names, renaming into place and
pruning are the store's (peer/checkpoint/store.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Optional, Tuple

from peer.checkpoint import framed, weights
from peer.checkpoint.files import Damaged, first_line, read_bounded, write_synced

logger = logging.getLogger("peer.checkpoint.store")  # the store's: its warnings are the ones operators grep for

INDEX_FILE = "checkpoint.json"
MODEL_FILE = "model.safetensors"
TRAINING_FILE = "training.pt"
INDEX_FORMAT = "swarmtrain-checkpoint"
INDEX_VERSION = 2  # version 1 is the single framed file
INDEX_LIMIT_BYTES = 64 << 20  # names and lengths only, even for a model with a million tensors
MODEL_KEY = "model"


def write_parts(directory: Path, state: dict, global_epoch: int, where: str) -> int:
    """Write the parts of `state` into the empty `directory`, each fsynced, the index last; their total bytes.

    :param where: the checkpoint's final name, for messages
    :raises CheckpointError: the state cannot be serialized
    :raises OSError: a part cannot be written or synced
    """
    model_data, layout = _encode_model(state.get(MODEL_KEY), where)
    rest = {**state, MODEL_KEY: None} if layout is not None else state  # the key stays, so that its place does
    training_data = framed.frame(rest, where)
    parts = {} if model_data is None else {MODEL_FILE: model_data}
    parts[TRAINING_FILE] = training_data
    index = {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "global_epoch": global_epoch,
        "files": {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                  for name, data in parts.items()},
        "model": None if layout is None else {"file": MODEL_FILE, **layout},
    }
    for name, data in parts.items():
        write_synced(directory / name, data)
    index_data = json.dumps({**index, "sha256": _digest_of(index)}, indent=1).encode()
    write_synced(directory / INDEX_FILE, index_data)
    return sum(map(len, parts.values())) + len(index_data)


def read_parts(directory: Path) -> Tuple[dict, str]:
    """(the state write_parts() was given, on the CPU; the sha256 of the index, which pins every part).

    :raises Damaged: the index or a part is missing, unreadable, or does not match
    """
    index_data = read_bounded(directory / INDEX_FILE, INDEX_LIMIT_BYTES)
    index = _parse_index(index_data)
    contents = {name: _read_part(directory / name, entry) for name, entry in index["files"].items()}
    state = framed.unframe(contents[TRAINING_FILE])
    layout = index["model"]
    if layout is not None:
        if MODEL_KEY not in state or state[MODEL_KEY] is not None:
            raise Damaged(f"{TRAINING_FILE} holds model weights although the index puts them in {MODEL_FILE}")
        state[MODEL_KEY] = weights.decode(contents[MODEL_FILE], layout)
    return state, hashlib.sha256(index_data).hexdigest()


def _encode_model(model_state, where: str) -> Tuple[Optional[bytes], Optional[dict]]:
    if not weights.is_encodable(model_state):
        return None, None
    try:
        return weights.encode(model_state)
    except ValueError as exc:  # a dtype safetensors lacks: the weights are still saved, pickled with the rest
        logger.warning("checkpoint %s keeps the model in %s: %s", where, TRAINING_FILE, first_line(exc))
        return None, None


def _parse_index(data: bytes) -> dict:
    try:
        index = json.loads(data)
    except ValueError as exc:
        raise Damaged(f"{INDEX_FILE} is not JSON ({first_line(exc)})") from exc
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise Damaged(f"{INDEX_FILE} is not a swarmtrain checkpoint index")
    if index.pop("sha256", None) != _digest_of(index):
        raise Damaged(f"sha256 of {INDEX_FILE} does not match the one it records (corrupted)")
    if index.get("version") != INDEX_VERSION:
        raise Damaged(f"unsupported checkpoint version {index.get('version')!r} (this build reads {INDEX_VERSION})")
    files, layout = index.get("files"), index.get("model", "missing")
    expected = {TRAINING_FILE} if layout is None else {TRAINING_FILE, MODEL_FILE}
    if not isinstance(files, dict) or set(files) != expected:
        raise Damaged(f"{INDEX_FILE} lists {sorted(files) if isinstance(files, dict) else files!r}, "
                      f"not {sorted(expected)}")
    if layout is not None and not (isinstance(layout, dict) and layout.get("file") == MODEL_FILE):
        raise Damaged(f"{INDEX_FILE} has no model layout")
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            raise Damaged(f"{INDEX_FILE} gives no length and sha256 for {name}")
    return index


def _digest_of(index: dict) -> str:
    return hashlib.sha256(json.dumps(index, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _read_part(path: Path, entry: dict) -> bytes:
    data = read_bounded(path, entry["bytes"])  # longer than the index says is damage, and is not read on
    if len(data) != entry["bytes"]:
        raise Damaged(f"{path.name} is truncated: {len(data)} bytes, the index says {entry['bytes']}")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise Damaged(f"sha256 of {path.name} does not match the index (corrupted)")
    return data
