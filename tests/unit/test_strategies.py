"""The strategy registry (averaging/registry.py): each strategy declares all its parts, and the config's choices,
help and rules, the run manifest and the payload accounting read them from there. No network."""
from __future__ import annotations

import inspect
import subprocess
import sys
import typing

import pytest
import torch
from hivemind.compression import NoCompression
from pydantic import ValidationError

from averaging.codecs.compression import (
    configured_codec,
    payload_bytes,
    powersgd_factors,
    round_codec,
    round_payload_bytes,
)
from averaging.config import REFUSABLE, AveragingConfig
from averaging.registry import DEFAULT_STRATEGY, GRADIENTS, LOW_RANK, PAYLOAD_TENSORS, STATE, STRATEGIES, STRATEGY_NAMES
from peer.config import OPTIONS_BY_CLI, load_config
from peer.runtime.manifest import UNSET, manifest_for

FIELDS = AveragingConfig.model_fields
SWITCHED_ON = {  # each refusable setting switched on, with what it needs besides
    "delay_updates": dict(delay_updates=True, offload_optimizer=True),
    "offload_optimizer": dict(offload_optimizer=True),
    "error_feedback": dict(error_feedback="on", grad_compression="int8"),
    "average_opt_statistics": dict(average_opt_statistics=["exp_avg"]),
}


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_every_strategy_declares_each_of_its_parts(name):
    strategy = STRATEGIES[name]
    assert strategy.name == name and strategy.help
    assert list(inspect.signature(strategy.load_builder()).parameters)[:3] == ["config", "replica", "parts"]
    for setting in (*strategy.settings, *strategy.shared_settings):  # the manifest reads them by their flags
        assert setting in FIELDS and setting in OPTIONS_BY_CLI, setting
    assert set(strategy.refuses) <= set(REFUSABLE) and all(strategy.refuses.values())
    if strategy.payload is not None:
        assert strategy.payload.tensors in PAYLOAD_TENSORS and strategy.payload.codec_setting in FIELDS
    others = [other for other in STRATEGIES.values() if other is not strategy]
    assert not any(set(strategy.settings) & set(other.settings) for other in others)  # a section is its own


def test_the_config_offers_the_registered_strategies_with_their_help():
    field = FIELDS["strategy"]
    assert typing.get_args(field.annotation) == STRATEGY_NAMES == tuple(STRATEGIES)
    assert field.default == DEFAULT_STRATEGY
    for strategy in STRATEGIES.values():
        assert f"{strategy.name} ({strategy.help})" in field.description


@pytest.mark.parametrize("name", STRATEGY_NAMES)
@pytest.mark.parametrize("setting", REFUSABLE)
def test_a_setting_a_strategy_refuses_is_refused_with_its_reason_and_the_others_take_it(name, setting):
    why = STRATEGIES[name].refuses.get(setting)
    if why is None:
        assert AveragingConfig(strategy=name, **SWITCHED_ON[setting]).strategy == name
        return
    with pytest.raises(ValidationError) as error:
        AveragingConfig(strategy=name, **SWITCHED_ON[setting])
    message = str(error.value)
    assert f"--averaging {name} ({why})" in message
    assert "--averaging " + "/".join(other for other in STRATEGY_NAMES if setting not in STRATEGIES[other].refuses) \
        in message


@pytest.mark.parametrize("owner", [strategy for strategy in STRATEGIES.values()
                                   if any(FIELDS[setting].annotation is bool for setting in strategy.settings)])
def test_a_switch_of_one_strategys_section_needs_that_strategy(owner):
    for setting in (setting for setting in owner.settings if FIELDS[setting].annotation is bool):
        assert getattr(AveragingConfig(strategy=owner.name, **{setting: True}), setting) is True
        for other in STRATEGY_NAMES:
            if other != owner.name:
                with pytest.raises(ValidationError, match=f"needs --averaging {owner.name} \\(got {other}"):
                    AveragingConfig(strategy=other, **{setting: True})


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_the_manifest_shares_the_settings_the_strategy_declares(name):
    config = load_config(flags={"averaging": name})
    settings = manifest_for(config, "bytelm", torch.nn.Linear(2, 1)).settings
    assert set(settings) == {"task", "model", "target_batch_size", "averaging", *STRATEGIES[name].shared_settings}
    assert settings["averaging"] == name


def test_an_unset_optional_setting_is_shared_as_unset_and_a_set_one_as_its_value():
    def group_size(flags: dict):
        config = load_config(flags={"averaging": "local-sgd", **flags})
        return manifest_for(config, "bytelm", torch.nn.Linear(2, 1)).settings["target_group_size"]

    assert group_size({}) == UNSET
    assert group_size({"target_group_size": 4}) == 4


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_payload_accounting_follows_the_declared_payload(name):
    params = [torch.zeros(256, 192), torch.zeros(192)]
    config = AveragingConfig(strategy=name, grad_compression="fp16", state_compression="uint8", powersgd_rank=4)
    payload = STRATEGIES[name].payload
    if payload is None:  # a strategy that sends nothing moves no bytes, in no codec
        assert round_payload_bytes(config, params) == 0 and round_codec(config) == "none"
        return
    assert round_codec(config) == getattr(config, payload.codec_setting)
    sent = {GRADIENTS: params, STATE: params * 2, LOW_RANK: powersgd_factors(params, rank=4)}[payload.tensors]
    codec = configured_codec(config, round_codec(config))
    replies = NoCompression() if payload.tensors == STATE else codec  # parameters' average goes losslessly
    expected = payload_bytes(sent, codec) + payload_bytes(sent, replies)
    assert round_payload_bytes(config, params, opt_statistics=1) == expected


def test_the_registry_and_the_config_load_without_torch():
    """The config is read before anything heavy is imported (`peer --help`): so is the registry it reads."""
    check = ("import sys; import averaging.config, averaging.registry; "
             "print(sorted(name for name in ('torch', 'hivemind') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
