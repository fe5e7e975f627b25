"""The run manifest: what this peer would train, checked against what the swarm trains before the first step.

A peer started with another task, model, target batch or averaging setting than its swarm
would otherwise fail in confusing ways: state downloads that break on shapes, rounds that
never form, epochs that advance at the wrong target. So before it builds its optimizer (which
would count its samples toward the swarm's progress) the peer reads the run's manifest:

- none anywhere, and no other peer of the run visible: this peer starts the run and stores it;
- one, equal to ours: train, and keep our copy of it alive;
- one that differs: exit 2 with one line per differing setting (ours, the swarm's, the flag);
  a legitimate change of settings needs a new --run-id;
- none, while other peers of the run are visible: the manifest could not be read; exit 1
  rather than train alone with settings nobody checked.

Settings that only matter to this peer (batch size, device, timeouts, ports) are not part of it.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable, Dict, List, Optional

import torch
from hivemind.utils import get_dht_time

from averaging.registry import STRATEGIES
from dht.keys import SwarmKeys
from dht.manifest import MANIFEST_TTL_SECONDS, PROTOCOL_VERSION, agreed_manifest, read_manifests
from dht.records import RunManifest, read_peer_infos, store_own
from peer.config import OPTIONS_BY_CLI, PeerConfig
from peer.exit_codes import BadInput
from peer.task_names import BUILTIN_TASK_NAMES

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5

_ADAPTIVE_CODEC_SETTINGS = ("adaptive_compression_threshold", "adaptive_large_codec")


class ManifestMismatch(BadInput):
    """This peer's settings differ from the swarm's: one line per setting."""


class ManifestUnreadable(RuntimeError):
    """Other peers of the run are visible, but no manifest could be read in time."""


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of the model's parameter and buffer names, shapes and dtypes: equal models, equal digests."""
    layout = "\n".join(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}" for name, tensor in model.state_dict().items())
    return hashlib.sha256(layout.encode()).hexdigest()[:16]


def manifest_for(config: PeerConfig, task_name: str, model: torch.nn.Module) -> RunManifest:
    """:param task_name: the task's own name (a module:function task that wraps a built-in keeps its name)"""
    averaging = config.averaging
    # the strategy's own shared settings, each read by its command-line name
    names = ["target_batch_size", "averaging", *STRATEGIES[averaging.strategy].shared_settings]
    if "adaptive" in (averaging.grad_compression, averaging.state_compression, averaging.load_state_compression):
        names += _ADAPTIVE_CODEC_SETTINGS
    settings: Dict[str, object] = {name: _setting(config, name) for name in names}
    settings["task"], settings["model"] = task_name, model_fingerprint(model)
    return RunManifest(protocol=PROTOCOL_VERSION, settings=settings, created=get_dht_time())


def differences(ours: RunManifest, swarm: RunManifest) -> List[str]:
    """One line per setting that differs, naming the flag that would make this peer match."""
    if ours.protocol != swarm.protocol:
        return [f"this peer speaks swarm protocol {ours.protocol}, the swarm {swarm.protocol}: install the "
                f"swarmtrain version the swarm runs, or start a new run with another --run-id"]
    core = ["task", "target_batch_size", "averaging", "model"]
    names = core + sorted((set(ours.settings) | set(swarm.settings)) - set(core))
    differs = {name for name in names if ours.settings.get(name) != swarm.settings.get(name)}
    if "averaging" in differs:  # the other strategy's own settings follow from it: name the strategy only
        differs &= set(core)
    if "task" in differs:  # another task has another model
        differs.discard("model")
    lines = []
    for name in (name for name in names if name in differs):
        mine, theirs = ours.settings.get(name), swarm.settings.get(name)
        if name == "model":
            lines.append(f"the model's parameters differ from the swarm's (layout {mine} here, {theirs} in the "
                         f"swarm): use the same task code and version as the swarm")
        elif theirs is None or mine is None:
            which = "this peer" if theirs is None else "the swarm"
            lines.append(f"{OPTIONS_BY_CLI[name].flag} is set only by {which} ({mine if mine is not None else theirs!r}"
                         f"); start with the swarm's settings")
        elif name == "task" and theirs not in BUILTIN_TASK_NAMES:  # a module:function task's own name
            lines.append(f"--task is {mine!r} here but {theirs!r} in the swarm; start with the --task "
                         f"module:function that builds the task named {theirs!r}")
        else:
            flag = OPTIONS_BY_CLI[name].flag
            lines.append(f"{flag} is {mine!r} here but {theirs!r} in the swarm; start with {flag} {theirs}")
    if lines:
        lines.append("every peer of a run must share these settings; to train with other settings, use a new --run-id")
    return lines


def join_run(dht, keys: SwarmKeys, ours: RunManifest, timeout_seconds: float,
             wait: Callable[[float], bool] = lambda seconds: bool(time.sleep(seconds))) -> Optional[RunManifest]:
    """Check ours against the run's manifest, or start the run with ours; the manifest this peer trains with.

    :param wait: sleeps up to the given seconds; True when the peer was asked to stop (then this returns None)
    :raises ManifestMismatch: the swarm trains with other settings (exit 2)
    :raises ManifestUnreadable: peers of the run are visible but their manifest is not (exit 1)
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        request_timeout = max(1.0, min(10.0, deadline - time.monotonic()))
        swarm = agreed_manifest(read_manifests(dht, keys.manifest, request_timeout))
        if swarm is None and not read_peer_infos(dht, keys.run_id, request_timeout):
            # nobody else is here: this peer starts the run. Peers started at the same moment each store their
            # own; reading back decides between them (the oldest of equally held manifests wins).
            store_own(dht, keys.manifest, ours.dict(), MANIFEST_TTL_SECONDS)
            swarm = agreed_manifest(read_manifests(dht, keys.manifest, request_timeout)) or ours
            if not differences(ours, swarm):
                logger.info("this peer starts the run: stored its manifest")
        if swarm is not None:
            problems = differences(ours, swarm)
            if problems:
                raise ManifestMismatch("\n".join(problems))
            return swarm  # the caller keeps this peer's copy of it alive
        if time.monotonic() >= deadline:
            raise ManifestUnreadable(
                f"peers of run {keys.run_id!r} are visible but no run manifest could be read within "
                f"{timeout_seconds:.0f}s; check that they run this version of swarmtrain and the same --swarm-key, "
                f"or raise --startup-timeout-seconds"
            )
        if wait(POLL_SECONDS):
            return None


def _setting(config: PeerConfig, cli_name: str):
    option = OPTIONS_BY_CLI[cli_name]
    value = getattr(getattr(config, option.section), option.name)
    return ",".join(value) if isinstance(value, list) else value
