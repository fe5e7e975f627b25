"""The digest of a state: what peers compare to know that they hold the same one (averaging/swarm/digests.py)."""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch

DIGEST_HEX_CHARS = 32


def state_digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order (dtype and shape included), as DIGEST_HEX_CHARS hex digits."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        tensor = tensor.detach().to("cpu").contiguous()
        hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return hasher.hexdigest()[:DIGEST_HEX_CHARS]
