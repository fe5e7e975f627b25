"""Low-bit codecs written here, in torch: blockwise int8 and int4 (absmax per block, packed).

They implement hivemind's CompressionBase, so an averager sends them like its own codecs.
hivemind picks the decoder by the message's compression type, an enum with only its own six
values: ours use ids above them (CODEC_IDS), which averaging/adapter/ registers.

The flattened tensor is cut into blocks of BLOCK values; each block is sent as its absolute
maximum (fp32) and its values rounded to the nearest of 2*127+1 (int8) or 2*7+1 (int4) levels
between -absmax and +absmax, two int4 values per byte. Outliers cost only their own block's
precision, unlike uint8's one range per tensor. Per fp32 value: 1.06 bytes (int8) and 0.56
(int4), ratios of 0.27 and 0.14.

The top-k codec is averaging/codecs/sparse.py (its int8 values go as an int8 message of this
module); its id is in CODEC_IDS with theirs.

A reducer encodes each part's average once, with the codec its senders used, and sends those same
bytes to every sender (averaging/adapter/runner.py), so every member decodes the same values; what
that encoding loses is carried by the reducer's own error feedback (averaging/pipeline/error_feedback.py).

Values that are not finite are sent as 0, with the rest of their block: a peer's own guard drops
such gradients before a round, so only a hostile peer sends them.

Every message starts with a small header (the block size), so that a receiver needs no setting
of the sender's to decode it. This module must not touch the network or hivemind's internals.
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
_HEADER = struct.Struct("<I")  # block size


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


CODEC_IDS: Dict[str, int] = {"int8": 64, "int4": 65, "topk": 66}
"""Compression type ids for hivemind's messages, of the codecs here and of top-k (averaging/codecs/sparse.py): above
hivemind's own enum's (0..5), never reused."""
