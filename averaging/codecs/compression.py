"""Codec names from the config mapped onto hivemind's compression classes, and payload sizes.

`make_codec` is the only place that knows which hivemind class a name stands for.
`payload_bytes` measures what a list of tensors costs on the wire under a codec (the
serialized buffers, as hivemind sends them), so that byte counters and the docs' (docs/strategies.md)
arithmetic use one number. `round_payload_bytes` sizes what one averaging round of a strategy
sends (its Payload in averaging/registry.py), and what the replies to it weigh. This module must
not start anything or touch the network. The 8-bit codecs decode only with the hivemind adapter
(averaging/adapter/) installed (a numpy 2 fix).
"""
from __future__ import annotations

from typing import Iterable, List, Sequence

import torch
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    Uniform8BitQuantization,
)
from hivemind.utils.math import get_flatten_greedy_dims

from averaging.codecs.lowbit import BlockwiseAbsmax
from averaging.codecs.sparse import TOPK_CHUNK, TOPK_FRACTION, TOPK_VALUE_BITS, TopK
from averaging.config import BITSANDBYTES_INSTALL, CODECS, AveragingConfig, bitsandbytes_available
from averaging.registry import LOW_RANK, STATE, STRATEGIES

_FIXED = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "scaled-fp16": ScaledFloat16Compression,
    "uint8": Uniform8BitQuantization,
    "quantile8": Quantile8BitQuantization,
    "blockwise8": BlockwiseQuantization,
}


def make_codec(name: str, adaptive_threshold: int = 2**16, adaptive_large_codec: str = "uint8",
               topk_fraction: float = TOPK_FRACTION, topk_value_bits: int = TOPK_VALUE_BITS,
               topk_chunk: int = TOPK_CHUNK) -> CompressionBase:
    """The hivemind codec for a config name. Raises ValueError naming the choices for an unknown name."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    if "blockwise8" in (name, adaptive_large_codec if name == "adaptive" else None) and not bitsandbytes_available():
        # hivemind would only fail at the first all-reduce, in the averager process: fail here instead
        raise ValueError(f"blockwise8 needs bitsandbytes; run {BITSANDBYTES_INSTALL}")
    if name == "adaptive":
        if adaptive_large_codec not in ("uint8", "quantile8", "blockwise8"):
            raise ValueError(
                f"adaptive large codec must be uint8, quantile8 or blockwise8 (got {adaptive_large_codec!r})"
            )
        return SizeAdaptiveCompression(
            threshold=adaptive_threshold, less=Float16Compression(), greater_equal=_FIXED[adaptive_large_codec]()
        )
    if name in ("int8", "int4"):
        return BlockwiseAbsmax(bits=int(name[3:]))
    if name == "topk":
        return TopK(topk_fraction, value_bits=topk_value_bits, chunk=topk_chunk)
    return _FIXED[name]()


def configured_codec(config: AveragingConfig, name: str) -> CompressionBase:
    """The codec `name` with the config's codec settings (the adaptive codec's, and top-k's)."""
    return make_codec(name, config.adaptive_compression_threshold, config.adaptive_large_codec, config.topk_fraction,
                      config.topk_value_bits, config.topk_chunk)


def codecs_from_config(config: AveragingConfig) -> dict:
    """Keyword arguments for hivemind.Optimizer: grad, state-averaging and state-download codecs."""
    return dict(
        grad_compression=configured_codec(config, config.grad_compression),
        state_averaging_compression=configured_codec(config, config.state_compression),
        load_state_compression=configured_codec(config, config.load_state_compression),
    )


def payload_bytes(tensors: Iterable[torch.Tensor], codec: CompressionBase) -> int:
    """Bytes of the serialized buffers of `tensors` under `codec` (headers of a few bytes each not counted)."""
    total = 0
    with torch.no_grad():
        for tensor in tensors:
            tensor = tensor.detach().to("cpu", torch.float32)
            total += len(codec.compress(tensor, CompressionInfo.from_tensor(tensor), allow_inplace=False).buffer)
    return total


def max_useful_powersgd_rank(param: torch.Tensor, min_compression_ratio: float = 0.5) -> int:
    """The highest rank at which hivemind's PowerSGD still compresses this matrix (powersgd_factors' rule)."""
    m, n = get_flatten_greedy_dims(param)
    return int((1 - min_compression_ratio) * param.numel() // (m + n))


def powersgd_factors(
    params: Sequence[torch.Tensor], rank: int, min_compression_ratio: float = 0.5
) -> List[torch.Tensor]:
    """The tensors one PowerSGD round sends: P (m x r) and Q (n x r) per compressed matrix, the rest as is.

    Mirrors hivemind's PowerSGDGradientAverager rule for which tensors it compresses.
    """
    sent: List[torch.Tensor] = []
    for param in params:
        if param.ndim > 1 and rank <= max_useful_powersgd_rank(param, min_compression_ratio):
            m, n = get_flatten_greedy_dims(param)
            sent += [torch.zeros(m, rank), torch.zeros(n, rank)]
            continue
        sent.append(torch.zeros(param.shape))
    return sent


def reply_codec(codec: CompressionBase, tensors: str) -> CompressionBase:
    """What a reducer's replies to contributions of `tensors` (a Payload's, averaging/registry.py) sent with `codec`
    are encoded with: the average of parameters goes losslessly, any other in the codec its senders used
    (averaging/adapter/runner.py)."""
    return NoCompression() if tensors == STATE else codec


def round_codec(config: AveragingConfig) -> str:
    """The name of the codec one averaging round of the configured strategy sends in; "none" if it sends nothing."""
    payload = STRATEGIES[config.strategy].payload
    return "none" if payload is None else getattr(config, payload.codec_setting)


def round_payload_bytes(config: AveragingConfig, params: Sequence[torch.Tensor], opt_statistics: int = 0) -> int:
    """Bytes of one peer's contribution to one averaging round of the configured strategy, plus the replies to
    it (the strategy's Payload, averaging/registry.py). In a group of N, each peer sends (N-1)/N of that, and
    receives as much (it reduces 1/N of everyone's).

    :param opt_statistics: how many parameter-shaped optimizer tensors a round of the parameters averages along
    """
    payload = STRATEGIES[config.strategy].payload
    if payload is None:
        return 0
    params = [p.detach() for p in params]
    codec = configured_codec(config, getattr(config, payload.codec_setting))
    if payload.tensors == STATE:
        sent = params * (1 + opt_statistics)
    elif payload.tensors == LOW_RANK:
        sent = powersgd_factors(params, config.powersgd_rank)
    else:  # GRADIENTS: one tensor per parameter
        sent = params
    return payload_bytes(sent, codec) + payload_bytes(sent, reply_codec(codec, payload.tensors))


def bytes_moved(round_payload: int, group_size: int, outcome: str) -> int:
    """What one peer sent in a round, and received (round_payload_bytes of its strategy; nothing if it failed)."""
    if outcome not in ("ok", "partial"):
        return 0
    n = max(1, group_size)
    return int((n - 1) / n * round_payload)
