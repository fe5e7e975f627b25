"""The top-k codec, chunked as SparseLoCo sends it: few values, indices of one or two bytes, values of a few bits.

The flattened tensor is cut into chunks of `chunk` values (a power of two, 16 to 65536). Each chunk keeps
its k = max(1, round(chunk x fraction)) values largest in magnitude; the last chunk, if shorter (r values),
keeps max(1, round(r x k / chunk)), halves up. Everything else decodes as 0. A message is, in this order:

- a header of 8 bytes: value bits, log2(chunk), the value block and k, so that a receiver needs no
  setting of the sender's (the tensor's shape and dtype travel in hivemind's message);
- the kept values' indices within their chunk, increasing within each chunk, chunk after chunk:
  one byte each (uint8) where chunk <= 256, else two (uint16);
- the kept values, in the same order, in `value_bits`:
    - 16: fp16 (clamped to its range), 2 bytes;
    - 8: a BlockwiseAbsmax(8) message (averaging/codecs/lowbit.py: a 4-byte header, an fp32 absmax
      per block of 64 values, int8 codes, the last block padded), 1 + 4/64 bytes;
    - 4 and 2: per block of VALUE_BLOCK (64) values an fp32 scale s (fp16 would flush the scales of
      small gradients to 0), then the codes, packed 2 or 4 to a byte, low bits first. The sign of s
      names the block's grid. Positive: mid-rise, code j of 2^b at s x (2j + 1 - 2^b) / (2^b - 1),
      no zero level (±s/3 and ±s for 2 bits), for kept values are mostly far from zero. Negative:
      mid-tread, code j at |s| x (j - m) / m with m = 2^(b-1) - 1, zero exact (-|s|, 0, |s| for 2
      bits), for a chunk with fewer than k values that are not 0 (an embedding's unused rows) sends
      zeros, which mid-rise would send as ±s/3. The sender picks each block's grid, and its s among
      fractions of its absmax (CLIPS), for the least squared error, so that a block's one large
      value does not push its small ones out to ±absmax/3. On real gradients that cuts the error of
      the kept values from 105% (absmax, mid-rise) to 26% at 2 bits, and from 17% to 10% at 4.
      1/2 + 4/64 or 1/4 + 4/64 bytes.

So a kept value costs (1 or 2) + (2, 1.0625, 0.5625 or 0.3125) bytes: 1.5625 at the defaults (chunks of
256, 4-bit values), against 6 for int32 indices and fp16 values. 4 bits are the default because, with
error feedback, they leave about the error of fp16 values, and 2 bits visibly more (docs/strategies.md).

A reducer encodes each part's average with this codec too (averaging/adapter/runner.py), and every member
decodes the same bytes: decoding uses exact conversions and single float32 operations per value (no
reductions, no library math), so the same bytes give the same values, bit for bit, on every peer.
Values that are not finite are sent as 0, and decode as 0 whatever a message holds (a peer's own guard
drops such gradients before a round: only a hostile peer sends them); a message whose indices are out of
their chunk or not increasing, or whose length does not match its header, is refused (ValueError). This
module must not touch the network or hivemind's internals.
"""
from __future__ import annotations

import math
import struct

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

from averaging.codecs.lowbit import CODEC_IDS, BlockwiseAbsmax
from averaging.config import TOPK_CHUNK_CHOICES, TOPK_VALUE_BITS_CHOICES

TOPK_FRACTION = 0.01
TOPK_CHUNK = 256
"""Values per chunk by default: an index fits in one byte."""
TOPK_VALUE_BITS = 4
"""Bits per kept value by default (see docs/strategies.md for the error each setting leaves)."""
VALUE_BLOCK = 64
"""Kept values per scale, at 2 and 4 bits."""
CLIPS = (1.0, 0.85, 0.7, 0.55, 0.4, 0.3, 0.2)
"""The fractions of a block's absmax its scale is chosen from, at 2 and 4 bits (the sender's choice alone: a
receiver reads the scale)."""
_HEADER = struct.Struct("<BBHI")  # value bits, log2(chunk), value block, k
_FP16_MAX = float(torch.finfo(torch.float16).max)
_INT8 = BlockwiseAbsmax(8)


def index_bytes(chunk: int) -> int:
    return 1 if chunk <= 256 else 2


def value_bytes(value_bits: int) -> float:
    """Bytes per kept value of its value and its share of the scales (headers aside)."""
    if value_bits == 16:
        return 2.0
    block = _INT8.block if value_bits == 8 else VALUE_BLOCK
    return value_bits / 8 + 4 / block


def kept_per_chunk(chunk: int, fraction: float) -> int:
    return min(chunk, max(1, round(chunk * fraction)))


def _kept_in_tail(rest: int, chunk: int, k: int) -> int:
    """What the last, shorter chunk of `rest` values keeps: k in proportion (half up), at least one."""
    return 0 if rest == 0 else min(rest, max(1, (2 * rest * k + chunk) // (2 * chunk)))


def _finite(values: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(values), values, torch.zeros((), dtype=values.dtype))


def _grids(bits: int) -> torch.Tensor:
    """Row 0: the mid-rise grid of 2**bits levels in [-1, 1], code j at (2j + 1 - 2**bits) / (2**bits - 1). Row 1:
    the mid-tread grid, code j at (j - m) / m with m = 2**(bits - 1) - 1, zero exact (the last code repeats 1)."""
    top, middle = 2**bits - 1, 2 ** (bits - 1) - 1
    rise = [(2 * j - top) / top for j in range(top + 1)]
    tread = [(min(j, 2 * middle) - middle) / middle for j in range(top + 1)]
    return torch.tensor([rise, tread], dtype=torch.float32)


def _codes(values: torch.Tensor, scale: torch.Tensor, bits: int, tread: bool) -> torch.Tensor:
    """Each value's nearest level on a grid scaled by `scale` (one per row of `values`)."""
    top, middle = 2**bits - 1, 2 ** (bits - 1) - 1
    steps = middle if tread else top / 2  # levels per unit of the scale, from the middle of the grid
    inverse = torch.where(scale > 0, steps / scale, torch.zeros_like(scale))
    codes = torch.round(values * inverse[:, None] + (middle if tread else top / 2))
    return codes.clamp_(0, 2 * middle if tread else top).to(torch.uint8)


def quantize_values(values: torch.Tensor, bits: int, block: int = VALUE_BLOCK) -> bytes:
    """fp32 scales, one per `block` values, then `bits`-bit codes packed low bits first (see the module's docstring)."""
    count = values.numel()
    blocks = math.ceil(count / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    padded[:count] = values
    padded = padded.view(blocks, block)
    real = (torch.arange(blocks * block) < count).view(blocks, block)  # the last block's padding costs nothing
    absmax = padded.abs().amax(dim=1)
    best_error = torch.full((blocks,), math.inf)
    scales, codes = torch.zeros(blocks), torch.zeros(blocks, block, dtype=torch.uint8)
    grids = _grids(bits)
    for tread in (False, True):
        for clip in CLIPS:  # a few candidates, each vectorized over every block
            scale = (absmax * clip).to(torch.float32)
            candidate = _codes(padded, scale, bits, tread)
            decoded = grids[int(tread)][candidate.long()] * scale[:, None]
            error = torch.where(real, decoded - padded, 0.0).square().sum(dim=1)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            scales = torch.where(better, -scale if tread else scale, scales)  # the sign bit names the grid
            codes = torch.where(better[:, None], candidate, codes)
    per_byte = 8 // bits
    codes = codes.view(-1)[: math.ceil(count / per_byte) * per_byte].view(-1, per_byte)  # blocks pad to whole bytes
    packed = torch.zeros(codes.shape[0], dtype=torch.uint8)
    for slot in range(per_byte):
        packed |= codes[:, slot] << (slot * bits)
    return scales.numpy().tobytes() + packed.numpy().tobytes()


def dequantize_values(buffer: bytes, offset: int, count: int, bits: int, block: int = VALUE_BLOCK) -> torch.Tensor:
    """The float32 values of `count` codes that quantize_values wrote at `offset` of `buffer`."""
    blocks, per_byte = math.ceil(count / block), 8 // bits
    scales = torch.from_numpy(np.frombuffer(buffer, dtype=np.float32, count=blocks, offset=offset).copy())
    packed = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, count=math.ceil(count / per_byte),
                                            offset=offset + 4 * blocks).copy())
    mask = 2**bits - 1
    codes = torch.stack([(packed >> (slot * bits)) & mask for slot in range(per_byte)], dim=1).view(-1)[:count]
    grid = torch.signbit(scales).long().repeat_interleave(block)[:count]
    scale_of_each = scales.abs().repeat_interleave(block)[:count]
    return _finite(_grids(bits)[grid, codes.long()] * scale_of_each)


def message_bytes(numel: int, chunk: int, k: int, value_bits: int) -> int:
    """The exact size of a message's buffer."""
    kept = (numel // chunk) * k + _kept_in_tail(numel % chunk, chunk, k)
    size = _HEADER.size + kept * index_bytes(chunk)
    if value_bits == 16:
        return size + 2 * kept
    if value_bits == 8:
        return size + 4 + (4 + _INT8.block) * math.ceil(kept / _INT8.block)  # it sends whole blocks
    return size + 4 * math.ceil(kept / VALUE_BLOCK) + math.ceil(kept * value_bits / 8)


class TopK(CompressionBase):
    """In each chunk of `chunk` values, the `fraction` largest in magnitude (at least one), as one- or two-byte
    indices within the chunk and `value_bits` (2, 4, 8 or 16) values: see the module's docstring."""

    def __init__(self, fraction: float = TOPK_FRACTION, value_bits: int = TOPK_VALUE_BITS, chunk: int = TOPK_CHUNK):
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1] (got {fraction})")
        if value_bits not in TOPK_VALUE_BITS_CHOICES:
            raise ValueError(f"value_bits must be 2, 4, 8 or 16 (got {value_bits})")
        if chunk not in TOPK_CHUNK_CHOICES:
            raise ValueError(f"chunk must be a power of two from 16 to 65536 (got {chunk})")
        self.fraction, self.value_bits, self.chunk = fraction, value_bits, chunk
        self.k = kept_per_chunk(chunk, fraction)
        self.compression_type = CODEC_IDS["topk"]

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        values = _finite(tensor.detach().reshape(-1).to(torch.float32))
        chunk, k = self.chunk, self.k
        full, rest = divmod(values.numel(), chunk)
        rows = values[: full * chunk].view(full, chunk)
        indices = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values  # sorted: checked on decode
        kept = [rows.gather(1, indices).view(-1)]
        indices = [indices.view(-1)]
        if rest:
            tail = values[full * chunk:]
            tail_indices = tail.abs().topk(_kept_in_tail(rest, chunk, k), sorted=False).indices.sort().values
            kept.append(tail[tail_indices])
            indices.append(tail_indices)
        kept, indices = torch.cat(kept), torch.cat(indices)
        index_type = np.uint8 if index_bytes(chunk) == 1 else np.uint16
        header = _HEADER.pack(self.value_bits, chunk.bit_length() - 1, VALUE_BLOCK, k)
        body = indices.numpy().astype(index_type).tobytes() + self._values(kept)
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=header + body, size=tensor.shape,
                                  dtype=str(tensor.dtype).replace("torch.", ""), requires_grad=tensor.requires_grad)

    def _values(self, kept: torch.Tensor) -> bytes:
        if self.value_bits == 16:
            return kept.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).numpy().tobytes()  # beyond, fp16 is inf
        if self.value_bits == 8:
            return _INT8.compress(kept, CompressionInfo.from_tensor(kept)).buffer
        return quantize_values(kept, self.value_bits)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer, numel = serialized_tensor.buffer, math.prod(serialized_tensor.size)
        if len(buffer) < _HEADER.size:
            raise ValueError(f"a topk message of {len(buffer)} bytes has no header")
        value_bits, log_chunk, value_block, k = _HEADER.unpack_from(buffer)
        chunk = 2**log_chunk
        if value_bits not in TOPK_VALUE_BITS_CHOICES or chunk not in TOPK_CHUNK_CHOICES or not 1 <= k <= chunk or (
                value_bits in (2, 4) and value_block != VALUE_BLOCK):
            raise ValueError(f"a topk message's header is not one this codec writes: value bits {value_bits}, "
                             f"chunk 2**{log_chunk}, value block {value_block}, k {k}")
        if len(buffer) != message_bytes(numel, chunk, k, value_bits):
            raise ValueError(f"a topk message of {len(buffer)} bytes for {numel} values, chunk {chunk}, k {k} and "
                             f"{value_bits}-bit values should be {message_bytes(numel, chunk, k, value_bits)}")
        full, rest = divmod(numel, chunk)
        kept = full * k + _kept_in_tail(rest, chunk, k)
        index_type = np.uint8 if index_bytes(chunk) == 1 else np.uint16
        within = torch.from_numpy(np.frombuffer(buffer, dtype=index_type, count=kept, offset=_HEADER.size)
                                  .astype(np.int64))
        offset = _HEADER.size + kept * index_bytes(chunk)
        rows, tail = within[: full * k].view(full, k), within[full * k:]
        if (rows >= chunk).any() or (tail >= rest).any() or (rows[:, 1:] <= rows[:, :-1]).any() or (
                tail[1:] <= tail[:-1]).any():  # distinct positions: no two values compete for one
            raise ValueError("a topk message's indices are out of their chunk or not increasing")
        positions = torch.cat([(rows + chunk * torch.arange(full)[:, None]).view(-1), tail + full * chunk])
        dense = torch.zeros(numel, dtype=torch.float32)
        dense[positions] = self._decode_values(buffer, offset, kept, value_bits)
        dtype = getattr(torch, serialized_tensor.dtype) if serialized_tensor.dtype else torch.float32
        return dense.reshape(tuple(serialized_tensor.size)).to(dtype)

    @staticmethod
    def _decode_values(buffer: bytes, offset: int, kept: int, value_bits: int) -> torch.Tensor:
        if value_bits == 16:
            half = np.frombuffer(buffer, dtype=np.float16, count=kept, offset=offset)
            return _finite(torch.from_numpy(half.astype(np.float32)))
        if value_bits == 8:
            if struct.unpack_from("<I", buffer, offset)[0] != _INT8.block:  # the int8 message's own header
                raise ValueError(f"a topk message's int8 values are not in blocks of {_INT8.block}")
            return _finite(_INT8.extract(runtime_pb2.Tensor(buffer=buffer[offset:], size=[kept], dtype="float32")))
        return dequantize_values(buffer, offset, kept, value_bits)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        per_value = index_bytes(self.chunk) + value_bytes(self.value_bits)
        return per_value * self.k / self.chunk / info.descriptor.dtype.itemsize
