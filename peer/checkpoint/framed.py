"""The framed pickle: a torch.save() payload behind a header with its length and sha256.

It was the whole checkpoint before model weights moved to safetensors (a file ``checkpoint-*.pt``, which
still loads), and it is now the ``training.pt`` part of one. Layout (all integers little-endian):

    offset  size  field
    0       8     magic b"SWRMCKPT"
    8       4     format version (uint32, currently 1)
    12      8     payload length in bytes (uint64)
    20      32    sha256 of the payload
    52      n     payload: torch.save() of a dict

Only what torch.load(weights_only=True) accepts is written, so that reading never runs pickled code.
"""
from __future__ import annotations

import hashlib
import io
import struct

import torch

from peer.checkpoint.files import CheckpointError, Damaged, first_line

MAGIC = b"SWRMCKPT"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, sha256
HEADER_SIZE_BYTES = HEADER.size


def frame(state: dict, where: str) -> bytes:
    """The header and payload of `state`, checked to load back with weights_only=True.

    :param where: the checkpoint's name, for the error message
    :raises CheckpointError: the state cannot be pickled, or holds a type that loading would refuse
    """
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
    except Exception as exc:
        raise CheckpointError(f"cannot serialize checkpoint {where}: {first_line(exc)}") from exc
    # Refuse now what loading would refuse later: a checkpoint that cannot be loaded with
    # weights_only=True is lost. Loading onto the meta device reads no tensor data.
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True, map_location="meta")
    except Exception as exc:
        raise CheckpointError(
            f"cannot save checkpoint {where}: state holds a type that weights_only loading rejects: {first_line(exc)}"
        ) from exc
    payload = buffer.getvalue()
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest()) + payload


def unframe(data: bytes) -> dict:
    """The dict a framed file holds, on the CPU.

    :raises Damaged: short, truncated, too long, another format, a digest mismatch, or a payload torch rejects
    """
    if len(data) < HEADER_SIZE_BYTES:
        raise Damaged(f"file is {len(data)} bytes, shorter than the {HEADER_SIZE_BYTES}-byte header")
    magic, version, length, digest = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise Damaged(f"bad magic {magic!r} (expected {MAGIC!r}); not a checkpoint or damaged header")
    if version != FORMAT_VERSION:
        raise Damaged(f"unsupported format version {version} (this build reads {FORMAT_VERSION})")
    payload = memoryview(data)[HEADER_SIZE_BYTES:]
    if len(payload) < length:
        raise Damaged(f"truncated: payload is {len(payload)} bytes, header says {length}")
    if len(payload) > length:
        raise Damaged(f"file is longer than the {length}-byte payload its header declares")
    if hashlib.sha256(payload).digest() != digest:
        raise Damaged("sha256 of the payload does not match the header (corrupted)")
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise Damaged(f"verified but torch.load failed: {first_line(exc)}") from exc
    if not isinstance(state, dict):
        raise Damaged(f"payload is a {type(state).__name__}, not a dict")
    return state
