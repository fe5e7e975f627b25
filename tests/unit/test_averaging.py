"""Averaging config rules, codecs and payload sizes, and adaptive deadlines: no network."""
from __future__ import annotations

import pytest
import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor

from averaging import adapter
from averaging.codecs.compression import make_codec, payload_bytes, powersgd_factors, round_payload_bytes
from averaging.config import AveragingConfig
from averaging.deadlines import AdaptiveDeadlines
from peer.config import ConfigError, load_config


@pytest.fixture(autouse=True, scope="module")
def numpy2_decoding():
    """The 8-bit codecs decode only with the adapter's numpy 2 fix, as in every peer."""
    adapter.install()


def real_tensors():
    """Tensors shaped and distributed like a small model's weights and gradients."""
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(256, 192, generator=generator) * 0.02,
        torch.randn(192, generator=generator) * 0.1 + 1.0,
        torch.randn(96, 64, generator=generator) * torch.randn(96, 64, generator=generator) * 1e-3,  # heavier tails
    ]


# (codec, payload ratio vs fp32, bound on the relative RMS error of a round trip)
CODEC_EXPECTATIONS = [
    ("none", 1.0, 0.0),
    ("fp16", 0.5, 1e-3),
    ("scaled-fp16", 0.5, 1e-3),
    ("uint8", 0.25, 0.15),
    ("quantile8", 0.25, 0.08),
    ("int8", 0.27, 0.01),
    ("int4", 0.14, 0.2),  # 15 levels: 0.15 on the heavy-tailed tensor
    ("adaptive", 0.25, 0.15),
]


@pytest.mark.parametrize("name, ratio, max_error", CODEC_EXPECTATIONS)
def test_codec_round_trip_error_and_payload_ratio(name, ratio, max_error):
    codec = make_codec(name, adaptive_threshold=1000)
    tensors = real_tensors()
    for tensor in tensors:
        # decoded the way the receiving peer decodes: through hivemind's own registry
        restored = deserialize_torch_tensor(codec.compress(tensor, CompressionInfo.from_tensor(tensor)))
        assert restored.shape == tensor.shape and restored.dtype == tensor.dtype
        relative_rms = float((restored - tensor).norm() / tensor.norm())
        assert relative_rms <= max_error, (name, relative_rms)
    fp32_bytes = sum(t.numel() * 4 for t in tensors)
    measured = payload_bytes(tensors, codec) / fp32_bytes
    assert measured == pytest.approx(ratio, abs=0.02), measured


def test_adaptive_sends_small_tensors_as_fp16_and_large_ones_as_8_bit():
    codec = make_codec("adaptive", adaptive_threshold=1000, adaptive_large_codec="quantile8")
    small, large = torch.randn(999), torch.randn(1000)
    assert payload_bytes([small], codec) == 2 * 999
    assert payload_bytes([large], codec) == 1000 + 256 * 4 + 8  # indices + codebook + its length


def test_powersgd_payload_is_the_low_rank_factors():
    params = [torch.zeros(256, 192), torch.zeros(192)]
    config = AveragingConfig(strategy="powersgd", powersgd_rank=4)
    factors = powersgd_factors(params, rank=4)
    assert [tuple(t.shape) for t in factors] == [(256, 4), (192, 4), (192,)]
    # a contribution and the replies to it, in the same codec
    assert round_payload_bytes(config, params) == 2 * 4 * (256 * 4 + 192 * 4 + 192)
    assert round_payload_bytes(AveragingConfig(grad_compression="fp16"), params) == 2 * 2 * (256 * 192 + 192)
    local_sgd = AveragingConfig(strategy="local-sgd", average_opt_statistics=["exp_avg", "exp_avg_sq"])
    assert round_payload_bytes(local_sgd, params, opt_statistics=2) == 2 * 3 * 4 * (256 * 192 + 192)
    # our codecs reply in their own codec: a reply weighs what a contribution weighs
    int4 = round_payload_bytes(AveragingConfig(grad_compression="int4"), params)
    assert int4 == 2 * payload_bytes(params, make_codec("int4"))


def test_unknown_codec_names_the_choices():
    with pytest.raises(ValueError, match="choose one of none, fp16, scaled-fp16, uint8, quantile8, blockwise8"):
        make_codec("zstd")


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"grad_compression": "zstd"}, "--grad-compression (averaging.grad_compression) = 'zstd' from flag "
                                       "--grad-compression: unknown codec; choose one of none, fp16"),
        ({"state_compression": "blockwise8"}, "pip install 'swarmtrain[bitsandbytes]'"),
        ({"adaptive_large_codec": "blockwise8"}, "pip install 'swarmtrain[bitsandbytes]'"),
        ({"averaging": "gossip"}, "--averaging (averaging.strategy) = 'gossip'"),
        ({"delay_updates": True}, "--delay-updates needs --offload-optimizer"),
        ({"delay_updates": True, "offload_optimizer": True, "averaging": "diloco"},
         "--delay-updates does not work with --averaging diloco"),
        ({"offload_optimizer": True, "averaging": "local-sgd"},
         "--offload-optimizer does not work with --averaging local-sgd"),
        ({"average_opt_statistics": "exp_avg,exp-avg"}, "--average-opt-statistics"),
        ({"matchmaking_seconds": "soon"}, "must be a number of seconds > 0 or 'auto'"),
        ({"averaging_timeout_seconds": "-1"}, "--averaging-timeout-seconds"),
        ({"matchmaking_seconds_min": "10", "matchmaking_seconds_max": "2"},
         "--matchmaking-seconds-min (10.0) is larger than --matchmaking-seconds-max (2.0)"),
        ({"outer_momentum": "1"}, "--outer-momentum"),
        ({"harmful_updates": "6"}, "--harmful-updates (6) is larger than --harmful-update-window (5)"),
        ({"load_state_compression": "fp16"}, "--load-state-compression fp16 loses precision, but with --averaging "
                                             "sync a downloaded state must equal its donor's bit for bit"),
    ],
)
def test_bad_averaging_config_is_one_line_naming_the_flag(flags, expected):
    if "bitsandbytes" in expected:
        from averaging.config import bitsandbytes_available

        if bitsandbytes_available():
            pytest.skip("bitsandbytes is installed here")
    with pytest.raises(ConfigError) as error:
        load_config(flags=flags)
    assert expected in str(error.value)
    assert all("\n" not in problem for problem in error.value.problems)


def test_auto_deadlines_and_lists_parse_from_every_source(tmp_path):
    config_file = tmp_path / "peer.toml"
    config_file.write_text("[averaging]\nmatchmaking_seconds = 'auto'\naverage_opt_statistics = ['exp_avg']\n")
    config = load_config(config_file, {"PEER_AVERAGING_TIMEOUT_SECONDS": "auto"}, {"averaging": "local-sgd"})
    assert config.averaging.matchmaking_seconds == "auto" and config.averaging.averaging_timeout_seconds == "auto"
    assert config.averaging.seconds("matchmaking_seconds") is None
    assert config.averaging.average_opt_statistics == ["exp_avg"]
    assert load_config(flags={"matchmaking_seconds": "2.5"}).averaging.seconds("matchmaking_seconds") == 2.5


# --- adaptive deadlines -------------------------------------------------------------------------


def auto_deadlines(**kwargs) -> AdaptiveDeadlines:
    return AdaptiveDeadlines(matchmaking_seconds=None, averaging_timeout_seconds=None,
                             matchmaking_bounds=(1.0, 20.0), timeout_bounds=(5.0, 100.0), **kwargs)


def test_timeout_follows_measured_rounds_within_bounds():
    deadlines = auto_deadlines()
    assert deadlines.current.averaging_timeout_seconds == 100.0  # nothing measured yet: the widest
    for seconds in (4.0, 6.0, 5.0):
        deadlines.observe_round("ok", seconds)
    assert deadlines.update().averaging_timeout_seconds == pytest.approx(12.0)  # 2 x the slowest recent round
    for _ in range(8):  # the window forgets the 6 s round
        deadlines.observe_round("ok", 3.0)
    assert deadlines.update().averaging_timeout_seconds == pytest.approx(6.0)
    for _ in range(8):
        deadlines.observe_round("ok", 0.1)
    assert deadlines.update().averaging_timeout_seconds == 5.0  # lower bound
    deadlines.observe_round("ok", 500.0)
    assert deadlines.update().averaging_timeout_seconds == 100.0  # upper bound


def test_timeouts_grow_the_deadline_until_rounds_fit():
    deadlines = auto_deadlines()
    for _ in range(8):
        deadlines.observe_round("ok", 5.0)
    assert deadlines.update().averaging_timeout_seconds == 10.0
    deadlines.observe_round("timeout", 10.0)
    assert deadlines.update().averaging_timeout_seconds == pytest.approx(15.0)
    deadlines.observe_round("timeout", 15.0)
    assert deadlines.update().averaging_timeout_seconds == pytest.approx(22.5)
    deadlines.observe_round("failed", 0.2)  # a failed round says nothing about how long a round takes
    assert deadlines.update().averaging_timeout_seconds == pytest.approx(22.5)


def test_matchmaking_is_a_fraction_of_the_expected_epoch_time_within_bounds():
    deadlines = auto_deadlines()
    assert deadlines.current.matchmaking_seconds == 1.0
    deadlines.observe_swarm(samples_per_second=100.0, target_batch_size=5000)  # 50 s epochs
    assert deadlines.update().matchmaking_seconds == pytest.approx(5.0)
    deadlines.observe_swarm(samples_per_second=1000.0, target_batch_size=5000)  # 5 s epochs
    assert deadlines.update().matchmaking_seconds == 1.0
    deadlines.observe_swarm(samples_per_second=1.0, target_batch_size=5000)
    assert deadlines.update().matchmaking_seconds == 20.0


def test_timeout_always_outlasts_matchmaking_and_fixed_values_pass_through():
    deadlines = auto_deadlines()
    for _ in range(8):
        deadlines.observe_round("ok", 0.5)
    deadlines.observe_swarm(samples_per_second=1.0, target_batch_size=5000)
    assert deadlines.update().averaging_timeout_seconds == 40.0  # 2 x 20 s matchmaking beats the 1 s rounds
    fixed = AdaptiveDeadlines(matchmaking_seconds=3.0, averaging_timeout_seconds=30.0)
    fixed.observe_round("ok", 100.0)
    fixed.observe_swarm(1.0, 10_000)
    assert not fixed.auto
    assert (fixed.update().matchmaking_seconds, fixed.update().averaging_timeout_seconds) == (3.0, 30.0)
