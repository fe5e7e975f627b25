"""hf-causal-lm's model configuration, tokenizer and starting weights are part of the run manifest: a peer with
another one is refused (real DHTs, in process), even where the model's parameter layout alone would not tell them
apart."""
from __future__ import annotations

import time
from pathlib import Path

import hivemind
import pytest
import torch

pytest.importorskip("transformers", reason="hf-causal-lm needs the hf extra: pip install -e '.[hf]'")

from dht.keys import SwarmKeys  # noqa: E402
from dht.records import RunManifest, record_validators  # noqa: E402
from dht.run_owner import RunOwnerKey  # noqa: E402
from peer.config import load_config  # noqa: E402
from peer.runtime.manifest import ManifestMismatch, differences, join_run, manifest_for  # noqa: E402
from peer.tasks import load_task  # noqa: E402
from peer.tasks.hf_tokenizer import byte_level_tokenizer  # noqa: E402
from tests.unit.test_hf_causal_lm import tiny_config, write_corpus  # noqa: E402

LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]


def hf_manifest(tmp_path: Path, model_config: Path, **flags) -> RunManifest:
    """The manifest of a peer of hf-causal-lm with this configuration, as the peer builds it."""
    config = load_config(flags={"task": "hf-causal-lm", "model_config": str(model_config),
                                "data": str(tmp_path / "corpus"), "seq_len": 64, **flags})
    task = load_task(config.training.task, options=config.task)
    torch.manual_seed(0)
    made = manifest_for(config, task.name, task.build_model(), task.shared_digests)
    return RunManifest(protocol=made.protocol, settings=made.settings, created=time.time())


@pytest.fixture
def configs(tmp_path):
    write_corpus(tmp_path / "corpus", files=1, paragraphs=10)
    # the same parameters, names and shapes; another rotary base: another model all the same
    return tiny_config(tmp_path / "swarms"), tiny_config(tmp_path / "mine", rope_theta=500000.0)


def test_another_configuration_or_tokenizer_is_named_by_its_flag(tmp_path, configs):
    swarms, mine = configs
    theirs, ours = hf_manifest(tmp_path, swarms), hf_manifest(tmp_path, mine)
    assert ours.settings["model"] == theirs.settings["model"]  # the layout fingerprint alone would let it in
    lines = differences(ours, theirs)
    assert lines[0].startswith("--model-config: this peer's model configuration differs from the swarm's (digest "
                               f"{ours.settings['model_config']} here, {theirs.settings['model_config']} in the swarm)")
    assert len(lines) == 2 and "use a new --run-id" in lines[1]
    unverified = differences(ours, theirs, verified=False)  # not told the owner: nothing vouches for the swarm's
    assert unverified[0] == (f"--model-config: this peer's model configuration (digest "
                             f"{ours.settings['model_config']}) differs from the run's")
    assert differences(hf_manifest(tmp_path, swarms), theirs) == []

    other = byte_level_tokenizer()
    other.add_special_tokens({"eos_token": "Ā"})  # byte 0's stand-in: the same 256 ids, and an end-of-text token
    other.save_pretrained(tmp_path / "tokenizer")
    assert len(other) == 256
    lines = differences(hf_manifest(tmp_path, swarms, tokenizer=str(tmp_path / "tokenizer")), theirs)
    assert lines[0].startswith("--tokenizer: this peer's tokenizer differs from the swarm's") and len(lines) == 2

    # a configuration of another layout is named by the flag, not as a layout the task code would explain
    wider = hf_manifest(tmp_path, tiny_config(tmp_path / "wider", hidden_size=64))
    lines = differences(wider, theirs)
    assert lines[0].startswith("--model-config: ") and len(lines) == 2

    # a run that starts from a model's weights: a peer that starts from the run's seed would be averaged with them
    task = load_task("hf-causal-lm", options=load_config(flags={
        "task": "hf-causal-lm", "model_config": str(swarms), "data": str(tmp_path / "corpus")}).task)
    torch.manual_seed(1)
    task.build_model().save_pretrained(tmp_path / "start")
    tuned = hf_manifest(tmp_path, swarms, init_from=str(tmp_path / "start"))
    lines = differences(theirs, tuned)
    assert lines[0].startswith("--init-from: this peer's starting point differs from the swarm's (digest seeded "
                               f"here, {tuned.settings['init_from']} in the swarm)") and len(lines) == 2
    assert differences(hf_manifest(tmp_path, swarms, init_from=str(tmp_path / "start")), tuned) == []


@pytest.mark.timeout(120)
def test_a_peer_with_another_configuration_is_refused_by_the_runs_manifest(tmp_path, configs):
    swarms, mine = configs
    keys = SwarmKeys.for_run("hf-manifest-test")
    first = hivemind.DHT(start=True, host_maddrs=LOCALHOST, record_validators=record_validators(keys))
    second = hivemind.DHT(start=True, host_maddrs=LOCALHOST, initial_peers=first.get_visible_maddrs(),
                          record_validators=record_validators(keys))
    try:
        started = join_run(first, keys, hf_manifest(tmp_path, swarms), lambda: RunOwnerKey.load_or_create(
            tmp_path / "owner"), None, 10.0)
        owner = RunOwnerKey.load_or_create(tmp_path / "owner").fingerprint
        with pytest.raises(ManifestMismatch) as refused:
            join_run(second, keys, hf_manifest(tmp_path, mine), lambda: RunOwnerKey.load_or_create(tmp_path / "b"),
                     owner, 10.0)
        assert str(refused.value).splitlines()[0].startswith("--model-config: this peer's model configuration "
                                                             "differs from the swarm's")
        joined = join_run(second, keys, hf_manifest(tmp_path, swarms),
                          lambda: RunOwnerKey.load_or_create(tmp_path / "b"), owner, 10.0)
        assert joined == started
    finally:
        second.shutdown()
        first.shutdown()
