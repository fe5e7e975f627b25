"""Low-bit codecs written here, in torch: blockwise int8 and int4 (absmax per block, packed) and top-k.

They implement hivemind's CompressionBase, so an averager sends them like its own codecs.
hivemind picks the decoder by the message's compression type, an enum with only its own six
values: ours use ids above them (CODEC_IDS), which averaging/adapter/ registers.

- int8 / int4: the flattened tensor is cut into blocks of BLOCK values; each block is sent as
  its absolute maximum (fp32) and its values rounded to the nearest of 2*127+1 (int8) or 2*7+1
  (int4) levels between -absmax and +absmax, two int4 values per byte. Outliers cost only their
  own block's precision, unlike uint8's one range per tensor. Per fp32 value: 1.06 bytes (int8)
  and 0.56 (int4), ratios of 0.27 and 0.14.
- topk: the TOPK_FRACTION of values largest in magnitude, as int32 indices and fp16 values (6
  bytes each), or with `value_bits=8` int8 values, blockwise as int8 above (5.06 bytes each);
  the rest are sent as zeros. At 1%, a ratio of 0.015 (0.0127 with int8 values).

A reducer encodes each part's average once, with the codec its senders used, and sends those same
bytes to every sender (averaging/adapter/runner.py), so every member decodes the same values; what
that encoding loses is carried by the reducer's own error feedback (averaging/pipeline/error_feedback.py).

Values that are not finite decode as 0 (int8 and int4: with the rest of their block): a peer's
own guard drops such gradients before a round, so only a hostile peer sends them.

Every message starts with a small header (the block size, or the number of values kept), so
that a receiver needs no setting of the sender's to decode it. This module must not touch the
network or hivemind's internals.
"""
from __future__ import annotations

import math
import struct
from typing import Dict

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

BLOCK = 64
TOPK_FRACTION = 0.01
_HEADER = struct.Struct("<I")  # block size (int8, int4) or values kept (topk)
_INT8_VALUES = 2**31  # a topk header's flag: the kept values follow as an int8 message


def _message(codec: "CompressionBase", tensor: torch.Tensor, body: bytes, header: int) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(compression=codec.compression_type, buffer=_HEADER.pack(header) + body,
                              size=tensor.shape, dtype=str(tensor.dtype).replace("torch.", ""),
                              requires_grad=tensor.requires_grad)


def _restore(serialized: runtime_pb2.Tensor, flat: torch.Tensor) -> torch.Tensor:
    dtype = getattr(torch, serialized.dtype) if serialized.dtype else torch.float32
    return flat.reshape(tuple(serialized.size)).to(dtype)


class BlockwiseAbsmax(CompressionBase):
    """Blockwise absmax quantization to `bits` (8 or 4) signed levels per value."""

    def __init__(self, bits: int, block: int = BLOCK):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8 (got {bits})")
        if block <= 0 or block % 2:
            raise ValueError(f"block must be a positive even number (two int4 values share a byte; got {block})")
        self.bits, self.block = bits, block
        self.levels = 2 ** (bits - 1) - 1  # 127 or 7: symmetric, so zero is exact
        self.compression_type = CODEC_IDS[f"int{bits}"]

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        values = tensor.detach().reshape(-1).to(torch.float32)
        blocks = math.ceil(values.numel() / self.block)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32)
        padded[: values.numel()] = values
        padded = padded.view(blocks, self.block)
        absmax = padded.abs().amax(dim=1)
        absmax = torch.where(torch.isfinite(absmax), absmax, torch.zeros_like(absmax))  # a NaN block decodes as 0
        scale = torch.where(absmax > 0, self.levels / absmax, torch.zeros_like(absmax))
        codes = torch.round(torch.nan_to_num(padded * scale[:, None])).clamp_(-self.levels, self.levels)
        codes = codes.to(torch.int8).view(-1)
        if self.bits == 4:
            nibbles = (codes + 8).to(torch.uint8)  # 1..15
            codes = (nibbles[0::2] | (nibbles[1::2] << 4)).view(torch.int8)  # block is even: pairs never straddle
        body = absmax.numpy().tobytes() + codes.numpy().tobytes()
        return _message(self, tensor, body, self.block)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        (block,) = _HEADER.unpack_from(buffer)
        numel = math.prod(serialized_tensor.size)
        blocks = math.ceil(numel / block)
        offset = _HEADER.size
        absmax = torch.from_numpy(np.frombuffer(buffer, dtype=np.float32, count=blocks, offset=offset).copy())
        offset += 4 * blocks
        codes = torch.from_numpy(np.frombuffer(buffer, dtype=np.int8, offset=offset).copy())
        if self.bits == 4:
            packed = codes.view(torch.uint8)
            nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)
            codes = nibbles.to(torch.int8) - 8
        values = codes[: blocks * block].to(torch.float32).view(blocks, block) * (absmax / self.levels)[:, None]
        return _restore(serialized_tensor, values.view(-1)[:numel])

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return (self.bits / 8 + 4 / self.block) / info.descriptor.dtype.itemsize


class TopK(CompressionBase):
    """The `fraction` of values largest in magnitude (at least one), as int32 indices and fp16 (`value_bits`
    16) or blockwise int8 (8) values."""

    def __init__(self, fraction: float = TOPK_FRACTION, value_bits: int = 16):
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1] (got {fraction})")
        if value_bits not in (8, 16):
            raise ValueError(f"value_bits must be 8 or 16 (got {value_bits})")
        self.fraction, self.value_bits = fraction, value_bits
        self.compression_type = CODEC_IDS["topk"]

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        values = torch.nan_to_num(tensor.detach().reshape(-1).to(torch.float32), nan=0.0, posinf=0.0, neginf=0.0)
        kept = min(values.numel(), max(1, math.ceil(values.numel() * self.fraction)))
        indices = values.abs().topk(kept, sorted=False).indices.sort().values  # sorted: compresses better
        body = indices.to(torch.int32).numpy().tobytes()
        if self.value_bits == 8:
            quantized = _INT8.compress(values[indices], CompressionInfo.from_tensor(values[indices]))
            return _message(self, tensor, body + quantized.buffer, kept | _INT8_VALUES)
        return _message(self, tensor, body + values[indices].to(torch.float16).numpy().tobytes(), kept)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        (kept,) = _HEADER.unpack_from(buffer)
        int8_values, kept = bool(kept & _INT8_VALUES), kept & ~_INT8_VALUES
        indices = np.frombuffer(buffer, dtype=np.int32, count=kept, offset=_HEADER.size)
        offset = _HEADER.size + 4 * kept
        if int8_values:
            values = _INT8.extract(runtime_pb2.Tensor(buffer=buffer[offset:], size=[kept], dtype="float32"))
        else:
            values = torch.from_numpy(np.frombuffer(buffer, dtype=np.float16, count=kept, offset=offset)
                                      .astype(np.float32))
        dense = torch.zeros(math.prod(serialized_tensor.size), dtype=torch.float32)
        dense[torch.from_numpy(indices.astype(np.int64))] = values
        return _restore(serialized_tensor, dense)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        per_value = 4 + (1 + 4 / BLOCK if self.value_bits == 8 else 2)
        return per_value * self.fraction / info.descriptor.dtype.itemsize


CODEC_IDS: Dict[str, int] = {"int8": 64, "int4": 65, "topk": 66}
"""Compression type ids for hivemind's messages: above its own enum's (0..5), never reused."""
_INT8 = BlockwiseAbsmax(8)  # topk's int8 values
