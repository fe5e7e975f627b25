"""The run manifest: what this peer would train, checked against what the swarm trains before the first step.

A peer started with another task, model, target batch or averaging setting than its swarm
would otherwise fail in confusing ways: state downloads that break on shapes, rounds that
never form, epochs that advance at the wrong target. So before it builds its optimizer (which
would count its samples toward the swarm's progress) the peer reads the run's manifest, which
the run's owner signed (dht/run_owner.py):

- with --run-owner (the join command the first peer prints carries it), only manifests that owner
  signed are read: one equal to ours: train; one that differs: exit 2 with one line per differing
  setting (ours, the swarm's, the flag); none while peers of the run are visible: exit 1 rather than
  train with settings nobody checked;
- without it, a signed manifest equal to ours is joined (whoever signed it: nothing is taken from
  it); one that differs and that a live peer of the run holds (dht/manifest.py: held_by_peers): exit
  2 naming the settings but not the manifest's values, which nobody vouched for (the fix is the first
  peer's join command); manifests that no peer of the run holds, such as a squatter's, are not judged;
- no manifest of the run and no peer of it visible (manifests stored by others ignored, without
  --run-owner): this peer starts the run, signs its own manifest with its run owner key and stores it.
  A squatter that also poses as a peer of the run (a PeerInfo under its manifest's key) makes a peer
  without --run-owner refuse to start (exit 2), never train with the squatter's settings.

A legitimate change of settings needs a new --run-id. Settings that only matter to this peer
(batch size, device, timeouts, ports) are not part of it.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable, Dict, List, Mapping, Optional

import torch
from hivemind.utils import get_dht_time

from averaging.registry import STRATEGIES
from dht.keys import SwarmKeys
from dht.manifest import MANIFEST_TTL_SECONDS, PROTOCOL_VERSION, agreed_manifest, held_by_peers, read_manifests
from dht.records import RunManifest, read_peer_infos, store_own
from dht.run_owner import RunOwnerKey, fingerprint
from peer.config import OPTIONS_BY_CLI, PeerConfig
from peer.exit_codes import BadInput
from peer.task_names import BUILTIN_TASK_NAMES

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5
UNSET = "unset"
"""A shared setting that a run leaves unset, as its manifest records it."""

_ADAPTIVE_CODEC_SETTINGS = ("adaptive_compression_threshold", "adaptive_large_codec")
_TOPK_CODEC_SETTINGS = ("topk_fraction", "topk_value_bits", "topk_chunk")
"""hivemind cuts a round into parts by the codec's estimated size: peers whose top-k settings differ cut different
parts, and every round would fail."""

TASK_DIGESTS = {"model_config": "model configuration", "tokenizer": "tokenizer", "init_from": "starting point"}
"""The settings a task shares as digests (Task.shared_digests), by the option that sets each, and what it is."""


class ManifestMismatch(BadInput):
    """This peer's settings differ from the swarm's: one line per setting."""


class ManifestUnreadable(RuntimeError):
    """Other peers of the run are visible, but no manifest could be read in time."""


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of the model's parameter and buffer names, shapes and dtypes: equal models, equal digests."""
    layout = "\n".join(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}" for name, tensor in model.state_dict().items())
    return hashlib.sha256(layout.encode()).hexdigest()[:16]


def manifest_for(config: PeerConfig, task_name: str, model: torch.nn.Module,
                 shared_digests: Mapping[str, str] = {}) -> RunManifest:
    """:param task_name: the task's own name (a module:function task that wraps a built-in keeps its name)
    :param shared_digests: the task's (Task.shared_digests), such as hf-causal-lm's model configuration's"""
    averaging = config.averaging
    # the strategy's own shared settings, each read by its command-line name
    names = ["target_batch_size", "averaging", *STRATEGIES[averaging.strategy].shared_settings]
    codecs = (averaging.grad_compression, averaging.state_compression, averaging.load_state_compression)
    if "adaptive" in codecs:
        names += _ADAPTIVE_CODEC_SETTINGS
    if "topk" in codecs:
        names += _TOPK_CODEC_SETTINGS
    settings: Dict[str, object] = {name: _setting(config, name) for name in names}
    settings["task"], settings["model"] = task_name, model_fingerprint(model)
    settings.update(shared_digests)
    return RunManifest(protocol=PROTOCOL_VERSION, settings=settings, created=get_dht_time())


def differences(ours: RunManifest, swarm: RunManifest, verified: bool = True) -> List[str]:
    """One line per setting that differs, naming the flag that would make this peer match.

    :param verified: whether this peer was told the run's owner; if not, nothing vouches for the swarm's
        values, so the lines name the settings but never advise taking a value from the manifest
    """
    if ours.protocol != swarm.protocol:
        return [f"this peer speaks swarm protocol {ours.protocol}, the swarm {swarm.protocol}: install the "
                f"swarmtrain version the swarm runs, or start a new run with another --run-id"]
    core = ["task", "target_batch_size", "averaging", "model", *TASK_DIGESTS]
    names = core + sorted((set(ours.settings) | set(swarm.settings)) - set(core))
    differs = {name for name in names if ours.settings.get(name) != swarm.settings.get(name)}
    if "averaging" in differs:  # the other strategy's own settings follow from it: name the strategy only
        differs &= set(core)
    if "task" in differs:  # another task has another model
        differs -= {"model", *TASK_DIGESTS}
    if "model_config" in differs:  # another configuration explains another layout: name the flag that fixes it
        differs.discard("model")
    describe = _difference if verified else _unverified_difference
    lines = [describe(name, ours.settings.get(name), swarm.settings.get(name))
             for name in names if name in differs]
    if lines and not verified:
        lines.append(f"this peer was not given the run's owner, so it cannot tell the run's manifest (signed by "
                     f"{fingerprint(swarm.owner)}) from a forged one: start it with the join command the run's first "
                     f"peer printed, with --run-owner, to learn the settings to use")
    if lines:
        lines.append("every peer of a run must share these settings; to train with other settings, use a new --run-id")
    return lines


def _difference(name: str, mine, theirs) -> str:
    if name in TASK_DIGESTS:
        flag = OPTIONS_BY_CLI[name].flag
        return (f"{flag}: this peer's {TASK_DIGESTS[name]} differs from the swarm's (digest {mine} here, {theirs} "
                f"in the swarm); start with the swarm's {flag} (the same built-in name, or a copy of its file)")
    if name == "model":
        return (f"the model's parameters differ from the swarm's (layout {mine} here, {theirs} in the swarm): use "
                f"the same task code and version as the swarm")
    if theirs is None or mine is None:
        which = "this peer" if theirs is None else "the swarm"
        return (f"{OPTIONS_BY_CLI[name].flag} is set only by {which} ({mine if mine is not None else theirs!r}); "
                f"start with the swarm's settings")
    if name == "task" and theirs not in BUILTIN_TASK_NAMES:  # a module:function task's own name
        return (f"--task is {mine!r} here but {theirs!r} in the swarm; start with the --task module:function that "
                f"builds the task named {theirs!r}")
    flag = OPTIONS_BY_CLI[name].flag
    return f"{flag} is {mine!r} here but {theirs!r} in the swarm; start with {flag} {theirs}"


def _unverified_difference(name: str, mine, theirs) -> str:
    if name in TASK_DIGESTS:
        return f"{OPTIONS_BY_CLI[name].flag}: this peer's {TASK_DIGESTS[name]} (digest {mine}) differs from the run's"
    if name == "model":
        return f"the model's parameter layout ({mine} here) differs from the run's manifest"
    setting = "--task" if name == "task" else OPTIONS_BY_CLI[name].flag
    return f"{setting} ({mine!r} here) differs from the run's manifest"


def join_run(dht, keys: SwarmKeys, ours: RunManifest, owner_key: Callable[[], RunOwnerKey], run_owner: Optional[str],
             timeout_seconds: float,
             wait: Callable[[float], bool] = lambda seconds: bool(time.sleep(seconds))) -> Optional[RunManifest]:
    """Check ours against the run's manifest, or start the run with ours; the signed manifest this peer trains with.

    :param owner_key: this peer's run owner key (made on first use), to sign with when it starts the run
    :param run_owner: the fingerprint of the run's owner (--run-owner), if this peer was given it
    :param wait: sleeps up to the given seconds; True when the peer was asked to stop (then this returns None)
    :raises ManifestMismatch: the swarm trains with other settings (exit 2)
    :raises ManifestUnreadable: peers of the run are visible but their manifest is not (exit 1)
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        request_timeout = max(1.0, min(10.0, deadline - time.monotonic()))
        copies = read_manifests(dht, keys.manifest, request_timeout, owner=run_owner)
        joined = _equal_to(ours, copies)
        if joined is not None:
            return joined  # the caller keeps this peer's copy of it alive
        peers = read_peer_infos(dht, keys.run_id, request_timeout)
        verified = run_owner is not None
        # without the owner, only manifests that peers of the run train with: anyone can store one
        judged = copies if verified else held_by_peers(copies, peers)
        if judged:
            raise ManifestMismatch("\n".join(differences(ours, agreed_manifest(judged), verified)))
        if not peers:
            key = owner_key()
            if not verified or run_owner == key.fingerprint:
                return _start_run(dht, keys, ours, key, copies)
        if time.monotonic() >= deadline:
            signed_by = "" if run_owner is None else f" signed by run owner {run_owner}"
            raise ManifestUnreadable(
                f"no run manifest{signed_by} of run {keys.run_id!r} could be read within {timeout_seconds:.0f}s"
                f"{' while its peers are visible' if peers else ''}; check that they run this version of "
                f"swarmtrain, the same --swarm-key{' and --run-owner' if run_owner else ''}, or raise "
                f"--startup-timeout-seconds"
            )
        if wait(POLL_SECONDS):
            return None


def _equal_to(ours: RunManifest, copies: Dict[bytes, RunManifest]) -> Optional[RunManifest]:
    """The signed manifest among copies that holds ours (the most held and oldest, of several owners)."""
    return agreed_manifest({holder: manifest for holder, manifest in copies.items()
                            if (manifest.protocol, manifest.settings) == (ours.protocol, ours.settings)})


def _start_run(dht, keys: SwarmKeys, ours: RunManifest, key: RunOwnerKey,
               ignored: Dict[bytes, RunManifest]) -> RunManifest:
    """Sign ours and store it. Manifests a peer not told the owner found while nobody trains are a squatter's:
    ignored. (Two peers that start a run at the same moment each sign their own; with equal settings, both
    manifests hold ours.)"""
    if ignored:
        owners = sorted({fingerprint(manifest.owner) for manifest in ignored.values()})
        logger.warning(f"ignoring run manifests signed by {', '.join(owners)}: no peer of run {keys.run_id!r} trains "
                       f"with them; this peer starts the run (peers that join with its --run-owner never read them)")
    signed = key.sign(ours, keys.manifest)
    store_own(dht, keys.manifest, signed.dict(), MANIFEST_TTL_SECONDS)
    logger.info(f"this peer starts the run: stored its manifest, signed by run owner {key.fingerprint}")
    return signed


def _setting(config: PeerConfig, cli_name: str):
    option = OPTIONS_BY_CLI[cli_name]
    value = getattr(getattr(config, option.section), option.name)
    if value is None:  # an optional setting left unset (--target-group-size): the manifest holds no None
        return UNSET
    return ",".join(value) if isinstance(value, list) else value
