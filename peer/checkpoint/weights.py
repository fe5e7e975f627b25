"""A model's state_dict as safetensors, which other tools read without this code or pickle.

safetensors refuses tensors that share memory and stores only contiguous data, while a state_dict often
holds both: tied weights (a Llama with tie_word_embeddings has one tensor under two names), views and
transposes. So a checkpoint stores each tied tensor once and records the other names in its layout, and
decode() gives the tie back, so that load_state_dict accepts the result and the tie holds as before. A
tensor that only overlaps another's memory, or is not contiguous, is stored as a contiguous copy.

The layout (plain JSON, kept in the checkpoint's index) also holds what safetensors cannot: the order of
the names and the module versions torch keeps in a state_dict's ``_metadata``.

This module must not read or write files: the checkpoint's format does (peer/checkpoint/parts.py).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from peer.checkpoint.files import Damaged, first_line

SAFETENSORS_METADATA = {"format": "pt"}  # what transformers checks before it loads a safetensors file as PyTorch's


def is_encodable(model_state) -> bool:
    """Whether `model_state` is a state_dict that safetensors can hold: str names to tensors, JSON metadata."""
    if not isinstance(model_state, Mapping):
        return False
    if not all(isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in model_state.items()):
        return False  # a module's extra state can be any object: the checkpoint pickles that model whole
    try:
        json.dumps(getattr(model_state, "_metadata", None))
    except (TypeError, ValueError):
        return False
    return True


def encode(model_state: Mapping[str, torch.Tensor]) -> Tuple[bytes, dict]:
    """(the bytes of a safetensors file, the layout decode() needs) of a state_dict that is_encodable().

    :raises ValueError: safetensors cannot hold one of the tensors (its dtype, or a meta tensor)
    """
    stored, tied = _store_each_tensor_once(model_state)
    try:
        data = save_safetensors(stored, metadata=SAFETENSORS_METADATA)
    except Exception as exc:  # safetensors raises its own error types for dtypes and devices it does not take
        raise ValueError(f"safetensors cannot store the model: {first_line(exc)}") from exc
    layout = {
        "names": list(model_state),
        "tied": tied,
        "ordered": isinstance(model_state, OrderedDict),
        "module_versions": getattr(model_state, "_metadata", None),
    }
    return data, layout


def decode(data: bytes, layout: dict) -> Dict[str, torch.Tensor]:
    """The state_dict encode() was given: same names in the same order, ties restored, on the CPU.

    :raises Damaged: the file does not parse, or does not hold what the layout names
    """
    try:
        tensors = load_safetensors(data)
        names: List[str] = list(layout["names"])
        tied: Dict[str, str] = dict(layout["tied"])
        ordered = bool(layout["ordered"])
        versions = None if layout["module_versions"] is None else OrderedDict(layout["module_versions"])
    except Exception as exc:  # a damaged file or layout can fail in any of safetensors' or Python's ways
        raise Damaged(f"model weights do not load: {first_line(exc)}") from exc
    expected = [name for name in names if name not in tied]
    if set(tensors) != set(expected) or len(set(expected)) != len(expected) or not set(tied.values()) <= set(expected):
        raise Damaged(f"model.safetensors holds {len(tensors)} tensors, not the {len(expected)} its layout names")
    state: Dict[str, torch.Tensor] = OrderedDict() if ordered else {}
    for name in names:
        # a view of the stored tensor: its own object, as in a state_dict, sharing memory as the tie did
        state[name] = tensors[tied[name]].detach() if name in tied else tensors[name]
    if versions is not None:
        state._metadata = versions  # what load_state_dict hands each module's version hooks
    return state


def with_every_name(model_state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The tensors of a state_dict ready for safetensors with every name present (a tied tensor is copied), for
    readers that know nothing of ties."""
    seen: set = set()
    return {name: _ready(tensor, seen) for name, tensor in model_state.items()}


def tied_names(model_state: Mapping[str, torch.Tensor]) -> List[List[str]]:
    """Groups of names that are one tensor (same memory, shape, strides and dtype), each group in state order."""
    groups: Dict[tuple, List[str]] = {}
    for name, tensor in model_state.items():
        key = _view_key(tensor)
        if key is not None:
            groups.setdefault(key, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _store_each_tensor_once(model_state: Mapping[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    stored: Dict[str, torch.Tensor] = {}
    tied: Dict[str, str] = {}
    first_of: Dict[tuple, str] = {}
    seen: set = set()
    for name, tensor in model_state.items():
        key = _view_key(tensor)
        if key is not None and key in first_of:
            tied[name] = first_of[key]
            continue
        if key is not None:
            first_of[key] = name
        stored[name] = _ready(tensor, seen)
    return stored, tied


def _ready(tensor: torch.Tensor, seen: set) -> torch.Tensor:
    """`tensor` as safetensors takes it: itself if it is contiguous and alone in its memory, else a contiguous
    copy (a transpose, a slice of a buffer, a second view of memory already stored). Adds its memory to `seen`."""
    storage = _storage_key(tensor)
    keep = storage not in seen and _stands_alone(tensor)
    if storage is not None:
        seen.add(storage)
    return tensor if keep else _contiguous_copy(tensor)


def _stands_alone(tensor: torch.Tensor) -> bool:
    """Contiguous and the whole of its memory: what safetensors stores as it is."""
    if tensor.device.type == "meta":
        return True  # safetensors reports it; a copy would not help
    return tensor.is_contiguous() and tensor.storage_offset() == 0 and (
        tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def _contiguous_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _storage_key(tensor: torch.Tensor) -> Optional[tuple]:
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return None  # no memory to share
    return tensor.device.type, tensor.device.index, tensor.untyped_storage().data_ptr()


def _view_key(tensor: torch.Tensor) -> Optional[tuple]:
    storage = _storage_key(tensor)
    if storage is None:
        return None
    return storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype
