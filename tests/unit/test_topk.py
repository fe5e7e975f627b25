"""The chunked top-k codec (averaging/codecs/sparse.py): what it keeps, what it costs, how close its values come,
error feedback over many rounds, and decoding that is the same on every peer."""
from __future__ import annotations

import math
import struct

import pytest
import torch
from hivemind.compression import CompressionInfo

from averaging.codecs.compression import configured_codec
from averaging.codecs.sparse import TopK, dequantize_values, index_bytes, quantize_values, value_bytes
from averaging.config import AveragingConfig
from averaging.pipeline.error_feedback import encode_with_feedback

HEADER = 8  # value bits, log2(chunk), value block, k


def message(codec: TopK, tensor: torch.Tensor):
    return codec.compress(tensor, CompressionInfo.from_tensor(tensor))


def round_trip(codec: TopK, tensor: torch.Tensor) -> torch.Tensor:
    return codec.extract(message(codec, tensor))


def gradient_like(numel: int, seed: int = 0) -> torch.Tensor:
    """Gaussian values with a few outliers of 50 standard deviations, as real gradients have."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    values[torch.randint(0, numel, (max(1, numel // 1000),), generator=generator)] *= 50
    return values


def sent_positions(sent) -> set:
    """The flat positions a message's index stream names (its header, then one index per kept value)."""
    _, log_chunk, _, k = struct.unpack_from("<BBHI", sent.buffer)
    chunk, numel = 2**log_chunk, math.prod(sent.size)
    width = 1 if chunk <= 256 else 2
    kept = len(expected_positions(torch.arange(numel, 0, -1), chunk, k))  # as many as any tensor of this length
    within = torch.frombuffer(bytearray(sent.buffer[HEADER:HEADER + width * kept]),
                              dtype=torch.uint8 if width == 1 else torch.int16).long()
    starts = torch.cat([torch.full((k,), start) for start in range(0, numel - numel % chunk, chunk)]
                       + [torch.full((kept - (numel // chunk) * k,), numel - numel % chunk)])
    return set((within + starts).tolist())


def expected_positions(values: torch.Tensor, chunk: int, k: int) -> set:
    """Each chunk's k largest magnitudes, chunk by chunk (the last, shorter one keeps k in proportion)."""
    flat, kept = values.reshape(-1), set()
    for start in range(0, flat.numel(), chunk):
        piece = flat[start:start + chunk].abs()
        keep = k if piece.numel() == chunk else min(piece.numel(), max(1, math.floor(piece.numel() * k / chunk + 0.5)))
        kept.update((piece.topk(keep).indices + start).tolist())
    return kept


@pytest.mark.parametrize("value_bits", [2, 4, 8, 16])
@pytest.mark.parametrize("chunk, numel", [(16, 16 * 40), (256, 3000), (1024, 5 * 1024 + 100), (256, 100)])
def test_each_chunk_keeps_exactly_its_largest_values(value_bits, chunk, numel):
    values = gradient_like(numel, seed=numel).reshape(-1, 10 if numel % 10 == 0 else 1)
    codec = TopK(0.02, value_bits, chunk)
    sent = message(codec, values)
    decoded = codec.extract(sent)
    assert decoded.shape == values.shape and decoded.dtype == values.dtype
    expected = expected_positions(values, chunk, codec.k)
    assert sent_positions(sent) == expected
    assert set(decoded.reshape(-1).nonzero().view(-1).tolist()) <= expected  # low bits may send a small one as 0


def test_the_shape_and_dtype_come_back_and_the_tail_chunk_keeps_in_proportion():
    values = gradient_like(256 * 4 + 128, seed=5).to(torch.bfloat16).reshape(2, -1)
    decoded = round_trip(TopK(0.02, 16, 256), values)  # k = 5 per chunk of 256; the tail of 128 keeps 3 (2.5 up)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == values.shape
    assert int(decoded.count_nonzero()) == 4 * 5 + 3


@pytest.mark.parametrize("bits", [2, 4])
def test_low_bit_values_fall_on_their_blocks_grid_within_half_a_step(bits):
    """A positive scale: the mid-rise grid (no zero, every value keeps its sign); a negative one: the mid-tread grid
    (zero exact). Either way each value lands on the level nearest it, within its block's scale."""
    values = gradient_like(1000, seed=bits) * 1e-3  # 1000: a padded last block
    top = 2**bits - 1
    codes = torch.cat([torch.tensor([top]), torch.randint(0, top + 1, (63,))])
    values[:64] = (2 * codes - top) / top * 2e-3  # a block on the mid-rise grid: it fits that one best
    values[64:128:2] = 0  # a block of zeros among values: the mid-tread grid sends them as 0
    buffer = quantize_values(values, bits)
    decoded = dequantize_values(buffer, 0, values.numel(), bits)
    signed = torch.frombuffer(bytearray(buffer[:4 * 16]), dtype=torch.float32).repeat_interleave(64)[:1000]
    scales, tread = signed.abs(), signed < 0
    assert not tread[0] and tread[64]
    padded = torch.cat([values, torch.zeros(24)]).view(16, 64)
    assert (scales <= padded.abs().amax(dim=1).repeat_interleave(64)[:1000]).all()  # a fraction of the absmax
    steps = torch.where(tread, torch.full((), 2.0 ** (bits - 1) - 1), torch.full((), (2.0**bits - 1) / 2))
    position = decoded / scales * steps  # in steps from the grid's middle
    offset = torch.where(tread, 0.0, 0.5)  # the mid-rise levels sit half a step off zero
    assert torch.allclose(position - offset, torch.round(position - offset), atol=1e-4)  # on the grid
    within = (decoded - values.clamp(-scales, scales)).abs()
    assert (within <= scales / steps / 2 * (1 + 1e-5)).all()  # the nearest level
    assert (decoded[~tread] * values[~tread] > 0).all() and (decoded * values >= 0).all()
    assert torch.equal(decoded[64:128:2], torch.zeros(32))


@pytest.mark.parametrize("value_bits", [2, 4])
def test_chunks_of_zeros_send_zeros_where_the_gradient_is_zero(value_bits):
    """An embedding's unused rows: chunks with fewer than k values that are not 0 send zeros among the others'
    values, which the mid-tread grid keeps at exactly 0 (mid-rise alone would send them as ±scale/3)."""
    generator = torch.Generator().manual_seed(1)
    gradient = torch.zeros(2048, 128)
    used = torch.rand(2048, generator=generator) < 0.05
    gradient[used] = torch.randn(int(used.sum()), 128, generator=generator)
    decoded = round_trip(TopK(0.01, value_bits, 256), gradient)
    assert decoded[gradient == 0].count_nonzero() == 0
    assert decoded[used].count_nonzero() > 0


@pytest.mark.parametrize("bits", [2, 4])
def test_the_scale_search_never_does_worse_than_the_blocks_absmax(bits):
    """Each block's scale is the best of a few fractions of its absmax, 1 among them: one large value no longer
    pushes the small ones of its block out to absmax / 3."""
    values = gradient_like(64 * 50, seed=11)
    top = 2**bits - 1
    blocks = values.view(50, 64)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    plain = (torch.round((blocks / absmax * top + top) / 2).clamp(0, top) * 2 - top) / top * absmax
    searched = dequantize_values(quantize_values(values, bits), 0, values.numel(), bits).view(50, 64)
    assert ((searched - blocks).square().sum(dim=1) <= (plain - blocks).square().sum(dim=1) * (1 + 1e-5)).all()
    assert float((searched - blocks).norm()) < float((plain - blocks).norm())


@pytest.mark.parametrize("value_bits, tolerance", [(16, 1e-3), (8, 1 / 127 / 2)])
def test_fp16_and_int8_values_come_within_their_precision(value_bits, tolerance):
    values = gradient_like(4096, seed=3)
    decoded = round_trip(TopK(0.05, value_bits, 256), values)
    kept = decoded != 0
    error = (decoded[kept] - values[kept]).abs()
    scale = values[kept].abs() if value_bits == 16 else values[kept].abs().max()
    assert (error <= scale * tolerance * 1.01).all()


@pytest.mark.parametrize("value_bits", [2, 4, 8, 16])
def test_small_empty_zero_and_non_finite_tensors(value_bits):
    codec = TopK(0.01, value_bits, 256)
    small = torch.tensor([0.5, -3.0, 1.0, 2.0, 0.1])  # smaller than a chunk: keeps one, the largest
    assert round_trip(codec, small).nonzero().view(-1).tolist() == [1]
    assert round_trip(codec, small)[1] == pytest.approx(-3.0, rel=0.01)
    assert round_trip(codec, torch.tensor([-2.5]))[0] == pytest.approx(-2.5, rel=0.01)
    assert round_trip(codec, torch.zeros(0)).shape == (0,)
    assert torch.equal(round_trip(codec, torch.zeros(3, 700)), torch.zeros(3, 700))
    hostile = gradient_like(1000)
    hostile[[3, 400, 999]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    decoded = round_trip(codec, hostile)
    assert torch.isfinite(decoded).all() and decoded[[3, 400, 999]].count_nonzero() == 0
    finite = torch.where(torch.isfinite(hostile), hostile, torch.zeros(()))
    assert set(decoded.nonzero().view(-1).tolist()) == expected_positions(finite, 256, codec.k)


def test_fraction_one_keeps_everything():
    values = gradient_like(1000)
    assert torch.equal(round_trip(TopK(1.0, 16, 256), values), values.half().float())
    sent = message(TopK(1.0, 2, 16), values)
    assert sent_positions(sent) == set(range(1000))


@pytest.mark.parametrize("value_bits, per_value", [(16, 2), (8, 1 + 4 / 64), (4, 0.5 + 4 / 64), (2, 0.25 + 4 / 64)])
@pytest.mark.parametrize("chunk", [16, 256, 512, 65536])
def test_a_kept_value_costs_its_index_and_its_value(value_bits, per_value, chunk):
    """The documented cost: 1 byte of index up to chunks of 256, 2 beyond, plus the value and its scale's share;
    a fixed header of 8 bytes (12 with int8 values, whose message has its own)."""
    codec = TopK(0.01, value_bits, chunk)
    chunks = 64 * max(1, 1024 // chunk)  # a multiple of 64: the kept values fill whole blocks of 64
    values = torch.randn(chunks * chunk)
    kept = chunks * codec.k
    size = len(message(codec, values).buffer)
    assert index_bytes(chunk) == (1 if chunk <= 256 else 2) and value_bytes(value_bits) == per_value
    assert size == HEADER + (4 if value_bits == 8 else 0) + kept * (index_bytes(chunk) + per_value)
    ratio = codec.estimate_compression_ratio(CompressionInfo.from_tensor(values))
    assert ratio == pytest.approx(size / values.nbytes, rel=0.01)


def test_the_default_sends_a_kept_value_in_about_a_quarter_of_the_old_six_bytes():
    codec = TopK()
    assert (codec.chunk, codec.value_bits, codec.k) == (256, 4, 3)
    values = torch.randn(256 * 1024)
    assert len(message(codec, values).buffer) / (3 * 1024) == pytest.approx(1 + 0.5 + 4 / 64, abs=0.01)


@pytest.mark.parametrize("value_bits", [2, 4])
def test_error_feedback_keeps_the_residual_bounded_and_the_sum_on_track(value_bits):
    """200 rounds of gradients that share a direction: the residual levels off, so the error of the accumulated
    sum, relative to the sum, keeps falling."""
    generator = torch.Generator().manual_seed(0)
    numel = 4096
    drift = torch.randn(numel, generator=generator)
    codec = TopK(0.05, value_bits, 256)
    meant, received, residual = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    norms, relative = [], {}
    for step in range(1, 201):
        values = drift + 2 * gradient_like(numel, seed=int(torch.randint(0, 2**31, (1,), generator=generator)))
        decoded, residual = encode_with_feedback(values, residual, codec)
        meant += values
        received += decoded
        norms.append(float(residual.norm()))
        relative[step] = float((received - meant).norm() / meant.norm())
    assert max(norms[100:]) < 1.5 * max(norms[25:50]), norms[::25]  # levelled off
    assert max(norms) < 3 * float(values.norm()), norms[::25]
    assert relative[200] < relative[50] / 2.5 and relative[200] < relative[100], relative


def test_decoding_gives_the_same_bits_every_time_and_on_any_instance():
    values = gradient_like(50_000, seed=9)
    for value_bits in (2, 4, 8, 16):
        sent = message(TopK(0.03, value_bits, 512), values)
        first = TopK().extract(sent)
        again = TopK(0.5, 16, 16).extract(sent)  # another peer's settings: the header decides
        assert torch.equal(first.view(torch.int32), again.view(torch.int32))
        assert torch.equal(first.view(torch.int32), TopK(0.03, value_bits, 512).extract(sent).view(torch.int32))


def test_a_message_that_this_codec_would_not_write_is_refused():
    codec = TopK(0.05, 4, 16)
    sent = message(codec, torch.randn(64))
    buffer = bytearray(sent.buffer)
    with pytest.raises(ValueError, match="should be"):
        codec.extract(type(sent)(buffer=bytes(buffer[:-1]), size=sent.size, dtype=sent.dtype))
    out_of_chunk = bytearray(buffer)
    out_of_chunk[HEADER] = 16  # indices are within chunks of 16
    with pytest.raises(ValueError, match="out of their chunk or not increasing"):
        codec.extract(type(sent)(buffer=bytes(out_of_chunk), size=sent.size, dtype=sent.dtype))
    bad_header = bytearray(buffer)
    bad_header[0] = 3  # 3-bit values
    with pytest.raises(ValueError, match="header"):
        codec.extract(type(sent)(buffer=bytes(bad_header), size=sent.size, dtype=sent.dtype))


def test_a_non_finite_scale_decodes_as_zero():
    codec = TopK(0.05, 2, 16)
    sent = message(codec, torch.randn(64))
    kept = 4 * codec.k
    buffer = bytearray(sent.buffer)
    struct.pack_into("<f", buffer, HEADER + kept, float("nan"))  # the first block's scale, after the indices
    decoded = codec.extract(type(sent)(buffer=bytes(buffer), size=sent.size, dtype=sent.dtype))
    assert torch.equal(decoded, torch.zeros(64))


def test_the_config_builds_the_codec_with_its_settings_and_the_same_defaults():
    def settings(codec):
        return codec.fraction, codec.value_bits, codec.chunk

    assert settings(configured_codec(AveragingConfig(), "topk")) == settings(TopK())
    config = AveragingConfig(topk_fraction=0.05, topk_value_bits=2, topk_chunk=1024)
    assert settings(configured_codec(config, "topk")) == (0.05, 2, 1024)
    with pytest.raises(ValueError, match="chunk must be a power of two from 16 to 65536"):
        TopK(chunk=100)
    with pytest.raises(ValueError, match="value_bits must be 2, 4, 8 or 16"):
        TopK(value_bits=3)
