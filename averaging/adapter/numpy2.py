"""numpy 2: upstream's Quantization.extract calls int() on a 1-element array, which numpy >= 2 rejects, so every
uint8/quantile8/blockwise8 all-reduce failed on the receiving side. Both extracts are copied here with that fix."""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import torch
from hivemind.proto import runtime_pb2


def _read_int64(buffer: bytes, offset: int = 0) -> int:
    return int(np.frombuffer(buffer, count=1, offset=offset, dtype=np.int64)[0])


def quantization_extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
    """Upstream's Quantization.extract, reading the codebook size in a way numpy 2 accepts."""
    buffer = serialized_tensor.buffer
    codebook_size = _read_int64(buffer)
    codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
    quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
    quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
    codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
    return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


def blockwise_extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
    """Upstream's BlockwiseQuantization.extract with the same numpy 2 fix."""
    from bitsandbytes.functional import dequantize_blockwise
    from hivemind.compression.quantization import _BLOCKWISE_QUANTIZATION_BLOCKSIZE

    buffer = serialized_tensor.buffer
    absmax_size, codebook_size = _read_int64(buffer), _read_int64(buffer, 8)
    absmax = np.frombuffer(buffer, offset=16, count=absmax_size, dtype=self.codebook_dtype)
    codebook = np.frombuffer(buffer, offset=16 + absmax.nbytes, count=codebook_size, dtype=self.codebook_dtype)
    quantized = np.frombuffer(buffer, offset=16 + absmax.nbytes + codebook.nbytes, dtype=self.indices_dtype)
    result = dequantize_blockwise(
        torch.as_tensor(quantized).reshape(tuple(serialized_tensor.size)), absmax=torch.as_tensor(absmax),
        code=torch.as_tensor(codebook), blocksize=_BLOCKWISE_QUANTIZATION_BLOCKSIZE, nested=False,
    )
    return result.to(getattr(torch, serialized_tensor.dtype)).requires_grad_(serialized_tensor.requires_grad)


PATCHES: Dict[str, Callable] = {
    "hivemind.compression.quantization.Quantization.extract": quantization_extract,
    "hivemind.compression.quantization.BlockwiseQuantization.extract": blockwise_extract,
}
