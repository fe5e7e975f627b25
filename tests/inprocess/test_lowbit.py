"""The low-bit codecs written here (averaging/codecs/lowbit.py): round trips, packing, and decoding by hivemind (with
top-k's, averaging/codecs/sparse.py, whose own tests are tests/unit/test_topk.py)."""
from __future__ import annotations

import math

import pytest
import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor

from averaging import adapter
from averaging.codecs.compression import make_codec, payload_bytes
from averaging.codecs.lowbit import BLOCK, CODEC_IDS, BlockwiseAbsmax
from tests.inprocess.test_robust_allreduce import average_all, averagers


def round_trip(codec, tensor: torch.Tensor) -> torch.Tensor:
    return codec.extract(codec.compress(tensor, CompressionInfo.from_tensor(tensor)))


def gradient_like(numel: int = 10_000, seed: int = 0) -> torch.Tensor:
    """Gaussian values with a few outliers of 50 standard deviations, as real gradients have."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    values[torch.randint(0, numel, (10,), generator=generator)] *= 50
    return values


@pytest.mark.parametrize("bits, levels", [(8, 127), (4, 7)])
def test_blockwise_error_is_within_half_a_level_of_each_blocks_absmax(bits, levels):
    codec = BlockwiseAbsmax(bits)
    values = gradient_like(1000).reshape(10, 100)  # 1000 is not a multiple of the block: a padded tail
    decoded = round_trip(codec, values)
    assert decoded.shape == values.shape and decoded.dtype == values.dtype
    flat_values, flat_decoded = values.reshape(-1), decoded.reshape(-1)
    for start in range(0, 1000, BLOCK):
        block = flat_values[start:start + BLOCK]
        error = (flat_decoded[start:start + BLOCK] - block).abs().max()
        assert error <= block.abs().max() / levels / 2 * (1 + 1e-5)
        assert flat_decoded[start:start + BLOCK].abs().max() == pytest.approx(float(block.abs().max()), rel=1e-6)


def test_blockwise_packs_to_the_stated_size_and_ratio():
    values = torch.randn(4096)
    blocks = 4096 // BLOCK
    for bits in (8, 4):
        codec = BlockwiseAbsmax(bits)
        message = codec.compress(values, CompressionInfo.from_tensor(values))
        assert len(message.buffer) == 4 + 4 * blocks + 4096 * bits // 8  # header, fp32 scales, codes
        ratio = codec.estimate_compression_ratio(CompressionInfo.from_tensor(values))
        assert ratio == pytest.approx(len(message.buffer) / values.nbytes, rel=0.01)
    assert payload_bytes([values], make_codec("int4")) < payload_bytes([values], make_codec("int8")) / 1.8


def test_int4_packs_two_values_per_byte_low_nibble_first():
    values = torch.tensor([7.0, -7.0, 0.0, 1.0] + [0.0] * (BLOCK - 4))  # absmax 7: each value is its own level
    message = BlockwiseAbsmax(4).compress(values, CompressionInfo.from_tensor(values))
    codes = message.buffer[8:]  # after the header and the block's scale
    assert len(codes) == BLOCK // 2
    assert codes[0] == (7 + 8) | ((-7 + 8) << 4) and codes[1] == (0 + 8) | ((1 + 8) << 4)
    assert torch.equal(BlockwiseAbsmax(4).extract(message), values)


def test_an_all_zero_block_and_non_finite_values_decode_as_zeros():
    values = torch.zeros(3 * BLOCK)
    values[BLOCK:2 * BLOCK] = torch.randn(BLOCK)
    values[2 * BLOCK + 3] = float("nan")
    decoded = round_trip(BlockwiseAbsmax(8), values)
    assert torch.equal(decoded[:BLOCK], torch.zeros(BLOCK))
    assert torch.isfinite(decoded).all() and torch.equal(decoded[2 * BLOCK:], torch.zeros(BLOCK))
    middle = values[BLOCK:2 * BLOCK]
    assert (decoded[BLOCK:2 * BLOCK] - middle).abs().max() < middle.abs().max() / 127


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
def test_hivemind_decodes_our_codecs_by_their_ids(name):
    adapter.install()
    values = gradient_like(3000).to(torch.bfloat16)  # the sender's dtype comes back
    codec = make_codec(name)
    message = codec.compress(values, CompressionInfo.from_tensor(values))
    assert message.compression == CODEC_IDS[name]
    decoded = deserialize_torch_tensor(message)
    assert decoded.dtype == torch.bfloat16 and torch.equal(decoded, codec.extract(message))


@pytest.mark.parametrize("value_bits, chunk", [(2, 16), (4, 256), (8, 1024), (16, 65536)])
def test_hivemind_decodes_every_topk_setting_with_the_one_registered_decoder(value_bits, chunk):
    """The decoder registered for topk's id has the default settings: each message's header carries its own."""
    adapter.install()
    values = gradient_like(70_000, seed=value_bits)
    codec = make_codec("topk", topk_fraction=0.02, topk_value_bits=value_bits, topk_chunk=chunk)
    message = codec.compress(values, CompressionInfo.from_tensor(values))
    assert message.compression == CODEC_IDS["topk"]
    assert torch.equal(deserialize_torch_tensor(message), codec.extract(message))


def test_blockwise_codecs_keep_outliers_from_flattening_the_rest():
    """uint8's one range per tensor loses the small values next to an outlier; a block loses only its own."""
    values = gradient_like(50_000, seed=1)
    relative = {name: float((round_trip(make_codec(name), values) - values).norm() / values.norm())
                for name in ("uint8", "int8", "int4")}
    assert relative["int8"] < relative["uint8"] / 5, relative
    assert relative["int4"] < 0.2, relative
    assert math.isfinite(relative["int4"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["int4", "topk"])
def test_two_real_averagers_average_through_our_codec(name):
    """hivemind's all-reduce with canonical replies, in averager processes that inherited the registration. Both
    peers end with the same decoded replies, the average less what the codec lost on both legs: small for int4,
    more for topk at 50% (no error feedback here)."""
    size = 2 * 2**17  # hivemind's parts are about 2**17 values: one for each of the two reducers
    values = [gradient_like(size, seed=seed) for seed in (1, 2)]
    mean = (values[0] + values[1]) / 2
    codec = make_codec(name, topk_fraction=0.5)
    with averagers([tensor.clone() for tensor in values], prefix=f"lowbit_{name}", compression=codec) as group:
        assert all(isinstance(result, dict) for result in average_all(group)), "the round failed"
        results = []
        for averager in group:
            with averager.get_tensors() as tensors:
                results.append(tensors[0].clone())
    assert torch.equal(results[0], results[1])
    assert torch.isfinite(results[0]).all()
    assert float((results[0] - mean).norm() / mean.norm()) < (0.2 if name == "int4" else 0.8)
