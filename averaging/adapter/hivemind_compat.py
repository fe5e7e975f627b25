"""The one seam to hivemind's internals: every patch we install, and a fingerprint of everything we copy or override.

hivemind is pinned (PINNED_VERSION). Where its behaviour is wrong for us, we either subclass it
(averaging/strategies/sync.py, averaging/strategies/state.py) or patch its classes here. Both depend on upstream code
we have read; UPSTREAM lists every such function with a fingerprint of its source, and the module
of ours that depends on it. After an upgrade, `changed_upstream()` names each one to re-read, and
`install()` refuses to run on another version whose fingerprinted code changed.

The patches, installed by `install()` (idempotent) before any averager process forks, since the
averager processes inherit the patched classes at fork:
- numpy 2: upstream's Quantization.extract calls int() on a 1-element array, which numpy >= 2
  rejects, so every uint8/quantile8/blockwise8 all-reduce failed on the receiving side;
- pacing: matchmaking re-reads its group key with no pause for the whole matchmaking window, and
  an averager re-declares itself as a state donor once per averaged tensor: about 200 DHT requests
  a second per peer on a 2-peer test swarm (1.6 cores), paced here to about 20 (0.5 cores), with
  as many epochs a second;
- open rounds: every round started in this process is recorded, so that a leaving peer can drop
  the rounds nobody will join (averaging/swarm/open_rounds.py);
- progress claims: a tracker with a ClaimFilter attached (averaging/swarm/claims.py) reads only the
  progress records that filter believes;
- robust aggregation and exclusion: an averager built with a Defence (averaging/pipeline/robust_allreduce.py)
  reduces with a RobustPartReducer and refuses excluded peers in matchmaking, all-reduce and state
  sharing. An averager built without one behaves as upstream;
- completeness: each all-reduce records the share of the average that never reached this peer, which
  upstream only logs (averaging/pipeline/completeness.py);
- codecs: hivemind decodes a message by the name of its compression type, an enum of its own six;
  our codecs (averaging/codecs/lowbit.py) send ids above those, registered here under names of their own;
- error feedback: an averager built with an ErrorFeedback averages its tensors plus the residuals
  carried, through a FeedbackPartContainer (averaging/pipeline/error_feedback.py).
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import logging
import time
import weakref
from typing import AsyncIterator, Callable, Dict, List, Tuple

import hivemind
import numpy as np
import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import aenumerate, as_aiter, azip

from averaging.codecs import lowbit
from averaging.pipeline import completeness, error_feedback, robust_allreduce

logger = logging.getLogger(__name__)

PINNED_VERSION = "1.1.12"
LOOKUP_INTERVAL_SECONDS = 0.1
DECLARE_INTERVAL_SECONDS = 0.5

_OPTIMIZER = "hivemind.optim.optimizer.Optimizer"
_STATE_AVERAGER = "hivemind.optim.state_averager.TrainingStateAverager"
_AVERAGER = "hivemind.averaging.averager.DecentralizedAverager"
_QUANTIZATION = "hivemind.compression.quantization"
_TRACKER = "hivemind.optim.progress_tracker.ProgressTracker"
_MATCHMAKING = "hivemind.averaging.matchmaking.Matchmaking"
_REDUCER = "hivemind.averaging.partition.TensorPartReducer"
_CONTAINER = "hivemind.averaging.partition.TensorPartContainer"

# qualified name -> (sha256 of its source, first 16 hex digits; the module of ours that depends on it)
UPSTREAM: Dict[str, Tuple[str, str]] = {
    # copied and patched here
    f"{_QUANTIZATION}.Quantization.extract": ("c522c9b6fd9ddaa2", "averaging/adapter/hivemind_compat.py"),
    f"{_QUANTIZATION}.BlockwiseQuantization.extract": ("83c934773cc388e2", "averaging/adapter/hivemind_compat.py"),
    f"{_AVERAGER}._declare_for_download_periodically": ("23ae6db0d205bcaf", "averaging/adapter/hivemind_compat.py"),
    "hivemind.averaging.key_manager.GroupKeyManager.get_averagers":
        ("916b0cdb1efbc75c", "averaging/adapter/hivemind_compat.py"),
    f"{_AVERAGER}.step": ("0bccfba139de5ec2", "averaging/adapter/hivemind_compat.py"),
    f"{_AVERAGER}._run_allreduce_inplace_": ("914d57cffc7d69e1", "averaging/adapter/hivemind_compat.py"),
    f"{_AVERAGER}.run": ("56590878daa9e5a0", "averaging/adapter/hivemind_compat.py"),
    f"{_AVERAGER}.run_in_background": ("028dd8b1e9b723d8", "averaging/adapter/hivemind_compat.py"),
    f"{_AVERAGER}.rpc_join_group": ("a0c1dec1f5165713", "averaging/adapter/hivemind_compat.py"),
    f"{_AVERAGER}.rpc_download_state": ("fd2f6f19e7d247af", "averaging/adapter/hivemind_compat.py"),
    f"{_AVERAGER}._load_state_from_peers": ("fe7b419d01ced5fe", "averaging/adapter/hivemind_compat.py"),
    f"{_MATCHMAKING}._request_join_group": ("df823040a94d1c1d", "averaging/adapter/hivemind_compat.py"),
    # subclassed by averaging/pipeline/robust_allreduce.py
    f"{_REDUCER}.__init__": ("9ebe1038f511931b", "averaging/pipeline/robust_allreduce.py"),
    f"{_REDUCER}.accumulate_part": ("1d64a8bd77052ac4", "averaging/pipeline/robust_allreduce.py"),
    f"{_REDUCER}.check_current_part_finished": ("ec9b059c42f3ca27", "averaging/pipeline/robust_allreduce.py"),
    f"{_REDUCER}.reset_accumulators": ("5d3dc36f344a342e", "averaging/pipeline/robust_allreduce.py"),
    f"{_REDUCER}.finalize": ("dded462a11871d59", "averaging/pipeline/robust_allreduce.py"),
    "hivemind.averaging.allreduce.AllReduceRunner.__init__":
        ("597a0c8dbbeabbe3", "averaging/pipeline/robust_allreduce.py, averaging/pipeline/error_feedback.py"),
    # subclassed by averaging/pipeline/error_feedback.py
    f"{_CONTAINER}.__init__": ("b652a9b7267354d8", "averaging/pipeline/error_feedback.py"),
    f"{_CONTAINER}.register_processed_part": ("ff5ebad6141c4a88", "averaging/pipeline/error_feedback.py"),
    f"{_CONTAINER}.register_failed_reducer": ("89b41b9d7f225968", "averaging/pipeline/error_feedback.py"),
    f"{_CONTAINER}.iterate_input_parts_for": ("e7a44eb8df9f9f26", "averaging/pipeline/error_feedback.py"),
    # overridden by SyncOptimizer, or mimicked by DiLoCoOptimizer
    f"{_OPTIMIZER}.__init__": ("310edba41646edad", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}._make_state_averager": ("59a43eff001c3284", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}._make_gradient_averager": ("b9a4450197c1e6fb", "dht/keys.py"),
    f"{_OPTIMIZER}._make_progress_tracker": ("a3fe70a367d732d6", "dht/keys.py"),
    f"{_OPTIMIZER}._update_global_epoch": ("03a36523a3fce65e", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}._check_and_accumulate_gradients": ("163c06c8f4909c30", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}._begin_averaging_gradients": ("f17d8bb258a0c551", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}._average_gradients_and_load_into_optimizer": ("d95bb5ebc061749e", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}._should_load_state_from_peers": ("e1af5bdfc8e60b70",
                                                    "averaging/strategies/sync.py, averaging/strategies/diloco.py"),
    f"{_OPTIMIZER}.load_state_from_peers": ("87030a961ecf8f7f", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}.shutdown": ("52e41b26128082bc", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}.state_dict": ("55bd9a9e33fa57c6", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}.load_state_dict": ("f27b8effe1d8a2d1", "averaging/strategies/sync.py"),
    # overridden by the guarded state averagers (and called with _make_state_averager's arguments)
    f"{_STATE_AVERAGER}.__init__": ("97f573400a46cdf9", "averaging/strategies/state.py"),
    f"{_STATE_AVERAGER}._apply_averaging_results_": ("32b49f6bd7088974", "averaging/strategies/state.py"),
    f"{_STATE_AVERAGER}.load_state_from_peers": ("e4d647a9ea78cde8", "averaging/strategies/state.py"),
    f"{_STATE_AVERAGER}._do": ("0b1896170cc6bdb0", "averaging/strategies/state.py"),
    f"{_AVERAGER}.load_state_from_peers": ("973fae40a3d1e16f", "averaging/strategies/state.py"),
    f"{_TRACKER}._parse_swarm_progress_data": ("1b5ad87469d3c13f", "averaging/adapter/hivemind_compat.py"),
    # read or driven from outside
    f"{_TRACKER}._progress_reporter": ("affc9ed95108eacf", "averaging/swarm/progress.py"),
    f"{_TRACKER}._progress_fetcher": ("ed458942519098a2", "averaging/swarm/progress.py"),
    "hivemind.optim.power_sgd_averager.PowerSGDGradientAverager.__init__":
        ("cabf7da27882b293", "averaging/codecs/compression.py"),
    "hivemind.compression.serialization.deserialize_torch_tensor": ("74f1eed9fb9b7de3",
                                                                     "averaging/adapter/hivemind_compat.py"),
}


class HivemindIncompatible(RuntimeError):
    """Another hivemind version whose code we copy or override has changed."""


def fingerprint(qualified_name: str) -> str:
    original = _UNPATCHED.get(qualified_name) or _resolve(qualified_name)
    return hashlib.sha256(inspect.getsource(original).encode()).hexdigest()[:16]


def changed_upstream() -> List[str]:
    """'name (used by our module)' for every fingerprinted upstream function whose source differs."""
    changed = []
    for name, (expected, used_by) in UPSTREAM.items():
        try:
            now = fingerprint(name)
        except (AttributeError, ImportError, KeyError, OSError, TypeError):
            now = "missing"
        if now != expected:
            changed.append(f"{name} (used by {used_by})")
    return changed


def install() -> None:
    """Check the hivemind version and install every patch (idempotent)."""
    if hivemind.__version__ != PINNED_VERSION:
        changed = changed_upstream()
        if changed:
            raise HivemindIncompatible(
                f"hivemind {hivemind.__version__} is installed, but swarmtrain was written against {PINNED_VERSION} "
                f"and these functions changed: {'; '.join(changed)}; run pip install hivemind=={PINNED_VERSION}"
            )
        logger.warning(f"hivemind {hivemind.__version__} (expected {PINNED_VERSION}); the code we rely on is unchanged")
    for name, patched in _PATCHES.items():
        owner, attribute = name.rsplit(".", 1)
        setattr(_resolve(owner), attribute, patched)
    _register_codecs()


def _resolve(qualified_name: str):
    """The function itself; on a class, only one defined in that class's own body (not inherited)."""
    parts = qualified_name.split(".")
    for split in range(len(parts) - 1, 0, -1):  # the longest importable prefix is the module
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            target = target.__dict__[attribute] if isinstance(target, type) else getattr(target, attribute)
        return target
    raise ImportError(qualified_name)


# --- our codecs ---------------------------------------------------------------------------------

_CODEC_NAMES = {codec_id: f"SWARMTRAIN_{name.upper()}" for name, codec_id in lowbit.CODEC_IDS.items()}
# each decodes any message of its id (settings are in the header); hivemind also encodes a reducer's replies with them
_DECODERS = {"int8": lowbit.BlockwiseAbsmax(8, dense_replies=True),
             "int4": lowbit.BlockwiseAbsmax(4, dense_replies=True), "topk": lowbit.TopK(dense_replies=True)}


def _register_codecs() -> None:
    """deserialize_torch_tensor looks a decoder up by CompressionType.Name(id): teach Name our ids, and the
    table our decoders (each reads its settings from the message's header, so one instance decodes all)."""
    from hivemind.compression import serialization

    for name, codec_id in lowbit.CODEC_IDS.items():
        serialization._BASE_COMPRESSION_TYPES[_CODEC_NAMES[codec_id]] = _DECODERS[name]
    enum = runtime_pb2.CompressionType
    if getattr(enum.Name, "knows_swarmtrain_codecs", False):
        return
    upstream_name = enum.Name

    def name_of(number: int) -> str:
        return _CODEC_NAMES.get(number) or upstream_name(number)

    name_of.knows_swarmtrain_codecs = True
    enum.Name = name_of


# --- numpy 2 ------------------------------------------------------------------------------------


def _read_int64(buffer: bytes, offset: int = 0) -> int:
    return int(np.frombuffer(buffer, count=1, offset=offset, dtype=np.int64)[0])


def _quantization_extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
    """Upstream's Quantization.extract, reading the codebook size in a way numpy 2 accepts."""
    buffer = serialized_tensor.buffer
    codebook_size = _read_int64(buffer)
    codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
    quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
    quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
    codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
    return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


def _blockwise_extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
    """Upstream's BlockwiseQuantization.extract with the same numpy 2 fix."""
    from bitsandbytes.functional import dequantize_blockwise
    from hivemind.compression.quantization import _BLOCKWISE_QUANTIZATION_BLOCKSIZE

    buffer = serialized_tensor.buffer
    absmax_size, codebook_size = _read_int64(buffer), _read_int64(buffer, 8)
    absmax = np.frombuffer(buffer, offset=16, count=absmax_size, dtype=self.codebook_dtype)
    codebook = np.frombuffer(buffer, offset=16 + absmax.nbytes, count=codebook_size, dtype=self.codebook_dtype)
    quantized = np.frombuffer(buffer, offset=16 + absmax.nbytes + codebook.nbytes, dtype=self.indices_dtype)
    result = dequantize_blockwise(
        torch.as_tensor(quantized).reshape(tuple(serialized_tensor.size)), absmax=torch.as_tensor(absmax),
        code=torch.as_tensor(codebook), blocksize=_BLOCKWISE_QUANTIZATION_BLOCKSIZE, nested=False,
    )
    return result.to(getattr(torch, serialized_tensor.dtype)).requires_grad_(serialized_tensor.requires_grad)


# --- pacing -------------------------------------------------------------------------------------


class Pacer:
    """Spaces calls at least `interval` seconds apart; `delay()` reserves the next slot."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval, self.clock = interval, clock
        self._next_slot = float("-inf")

    def delay(self) -> float:
        """Seconds to wait before the caller's turn; callers that arrive together queue up."""
        now = self.clock()
        slot = max(now, self._next_slot)
        self._next_slot = slot + self.interval
        return slot - now


_unpaced_get_averagers = GroupKeyManager.get_averagers  # the wrapper calls the original


async def _paced_get_averagers(self: GroupKeyManager, group_key, only_active: bool):
    if not hasattr(self, "_lookup_pacer"):
        self._lookup_pacer = Pacer(LOOKUP_INTERVAL_SECONDS)
    await asyncio.sleep(self._lookup_pacer.delay())
    return await _unpaced_get_averagers(self, group_key, only_active)


async def _paced_declare_for_download_periodically(self: DecentralizedAverager):
    # upstream's DecentralizedAverager._declare_for_download_periodically, plus the pause marked below
    download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
    sharing_was_allowed = self.allow_state_sharing
    while True:
        expiration_time = get_dht_time() + self.declare_state_period
        if self.allow_state_sharing or sharing_was_allowed:
            asyncio.create_task(
                asyncio.wait_for(
                    self.dht.store(
                        download_key,
                        subkey=self.peer_id.to_bytes(),
                        value=self.state_sharing_priority if self.allow_state_sharing else None,
                        expiration_time=expiration_time,
                        return_future=True,
                    ),
                    timeout=expiration_time - get_dht_time(),
                )
            )
            sharing_was_allowed = self.allow_state_sharing
        self._state_updated.clear()
        # the pause: an update that arrives meanwhile leaves _state_updated set, so the next store carries it
        await asyncio.sleep(DECLARE_INTERVAL_SECONDS)
        try:
            await asyncio.wait_for(self._state_updated.wait(), timeout=max(0.0, expiration_time - get_dht_time()))
        except asyncio.TimeoutError:
            pass


# --- open rounds --------------------------------------------------------------------------------

open_rounds: "weakref.WeakSet[StepControl]" = weakref.WeakSet()
"""Every round started in this process with wait=False that is still referenced somewhere."""
_unrecorded_step = DecentralizedAverager.step


def _recorded_step(self: DecentralizedAverager, *args, **kwargs):
    result = _unrecorded_step(self, *args, **kwargs)
    if isinstance(result, StepControl):  # wait=False: the round goes on in the background
        open_rounds.add(result)
    return result


# --- progress claims ---------------------------------------------------------------------------

_unfiltered_parse = ProgressTracker._parse_swarm_progress_data


def _filtered_parse(self: ProgressTracker, metadata):
    claims = getattr(self, "claims", None)  # set by averaging/swarm/progress.py on the trackers we build
    if claims is not None and isinstance(metadata, dict):
        metadata = claims.filter(metadata, get_dht_time(), local_epoch=self.local_progress.epoch)
    return _unfiltered_parse(self, metadata)


# --- robust aggregation and exclusion --------------------------------------------------------------

_plain_run_in_background = DecentralizedAverager.run_in_background
_plain_run = DecentralizedAverager.run
_plain_rpc_join_group = DecentralizedAverager.rpc_join_group
_plain_rpc_download_state = DecentralizedAverager.rpc_download_state
_plain_request_join_group = Matchmaking._request_join_group
_plain_get_stub = DecentralizedAverager.get_stub


def _run_in_background_prepared(self: DecentralizedAverager, *args, **kwargs):
    # before the fork: the averager's process inherits both
    robust_allreduce.defences.attach(self)
    error_feedback.carry(self)
    completeness.attach(self)
    return _plain_run_in_background(self, *args, **kwargs)


def _run_with_defence(self: DecentralizedAverager):
    robust_allreduce.activate_defence(self)  # in the averager's own process
    return _plain_run(self)


async def _run_allreduce_inplace_recorded(self: DecentralizedAverager, tensors, group_info: GroupInfo,
                                          group_id=None, **kwargs):
    # upstream's DecentralizedAverager._run_allreduce_inplace_, with a RobustAllReduceRunner when this
    # averager carries a Defence, and the share of the average that never arrived recorded for the
    # training process (averaging/pipeline/completeness.py). A group that a leader unaware of an exclusion formed
    # with an excluded peer is not left: this peer's reducers drop what it sends, and a peer that has not
    # excluded it yet gets to judge it (leaving such groups split the swarm: the unaware peer averaged
    # with the attacker alone). With error feedback, the runner averages x = tensors + residuals.
    defence = robust_allreduce.active
    group_id = group_info.group_id if group_id is None else group_id
    runner_class, extra = AllReduceRunner, {}
    if defence is not None:
        runner_class, extra = robust_allreduce.RobustAllReduceRunner, dict(defence=defence)
    feedback = error_feedback.of(self)
    if feedback is not None and not feedback.matches(tensors):
        feedback = None  # not this averager's own tensors
    if feedback is not None:
        with feedback.lock:
            carried = [residual.clone() for residual in feedback.residuals]
        inputs = [tensor.detach().float() + residual for tensor, residual in zip(tensors, carried)]
    runner = runner_class(
        p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=inputs if feedback else tensors,
        group_id=group_id, ordered_peer_ids=group_info.peer_ids, **extra, **kwargs,
    )
    if feedback is not None:
        _carry_residuals(runner, inputs, carried, kwargs)
    assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
    self._running_groups[group_id].set_result(runner)
    if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
        async for index, (tensor, update) in aenumerate(azip(as_aiter(*tensors), runner)):
            if feedback is None:
                tensor.add_(update, alpha=self._averaging_alpha)
            else:  # x + update is the average; the residual of this tensor is now final
                tensor.add_(inputs[index] + update - tensor, alpha=self._averaging_alpha)
                with feedback.lock:
                    feedback.residuals[index].copy_(runner.tensor_part_container.kept[index])
            self.last_updated = get_dht_time()
            self._state_updated.set()
        container = runner.tensor_part_container
        completeness.record(self, group_info.group_id, container.failed_size, container.total_size)
    else:
        async for _ in runner:
            raise ValueError("aux peers should not receive averaged tensors")


def _carry_residuals(runner: AllReduceRunner, inputs, carried, kwargs) -> None:
    """Replace the runner's part container (built in its __init__) by one that carries the residuals."""
    own_index = runner.ordered_peer_ids.index(runner.peer_id)
    container_options = {key: kwargs[key] for key in ("compression", "part_size_bytes") if key in kwargs}
    runner.tensor_part_container = error_feedback.FeedbackPartContainer(
        inputs, runner.peer_fractions, carried, own_index, **container_options)
    runner.parts_for_local_averaging = runner.tensor_part_container.get_raw_input_parts(own_index)


async def _rpc_join_group_refusing_excluded(
    self: DecentralizedAverager, request: averaging_pb2.JoinRequest, context: P2PContext
) -> AsyncIterator[averaging_pb2.MessageFromLeader]:  # hivemind's servicer reads these annotations
    if robust_allreduce.is_excluded(context.remote_id):
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return
    async for response in _plain_rpc_join_group(self, request, context):
        yield response


async def _request_join_group_skipping_excluded(self: Matchmaking, leader):
    if robust_allreduce.is_excluded(leader):
        return None  # upstream's answer for a leader that did not take us: try the next one
    return await _plain_request_join_group(self, leader)


async def _rpc_download_state_refusing_excluded(
    self: DecentralizedAverager, request: averaging_pb2.DownloadRequest, context: P2PContext
) -> AsyncIterator[averaging_pb2.DownloadData]:
    if robust_allreduce.is_excluded(context.remote_id):
        return  # upstream's answer when sharing is off: the peer moves on to the next donor
    async for message in _plain_rpc_download_state(self, request, context):
        yield message


class _NoStateStub:
    """A stub to an excluded peer as a state donor: it sends nothing, so upstream moves on to the next."""

    def __init__(self, stub):
        self._stub = stub

    def __getattr__(self, name):
        return getattr(self._stub, name)

    async def rpc_download_state(self, request):
        return as_aiter()


@classmethod
def _get_stub_without_excluded_donors(cls, p2p, peer, *, namespace=None):
    # called as self.get_stub only by upstream's _load_state_from_peers; the other callers go through
    # the class and reach excluded peers only in rounds that the patches above refuse anyway
    stub = _plain_get_stub.__func__(cls, p2p, peer, namespace=namespace)
    return _NoStateStub(stub) if robust_allreduce.is_excluded(peer) else stub


_PATCHES: Dict[str, Callable] = {
    f"{_QUANTIZATION}.Quantization.extract": _quantization_extract,
    f"{_QUANTIZATION}.BlockwiseQuantization.extract": _blockwise_extract,
    "hivemind.averaging.key_manager.GroupKeyManager.get_averagers": _paced_get_averagers,
    f"{_AVERAGER}._declare_for_download_periodically": _paced_declare_for_download_periodically,
    f"{_AVERAGER}.step": _recorded_step,
    f"{_TRACKER}._parse_swarm_progress_data": _filtered_parse,
    f"{_AVERAGER}.run_in_background": _run_in_background_prepared,
    f"{_AVERAGER}.run": _run_with_defence,
    f"{_AVERAGER}._run_allreduce_inplace_": _run_allreduce_inplace_recorded,
    f"{_AVERAGER}.rpc_join_group": _rpc_join_group_refusing_excluded,
    f"{_AVERAGER}.rpc_download_state": _rpc_download_state_refusing_excluded,
    f"{_AVERAGER}.get_stub": _get_stub_without_excluded_donors,
    f"{_MATCHMAKING}._request_join_group": _request_join_group_skipping_excluded,
}
# the upstream originals, kept so that they can still be fingerprinted once patched
_UNPATCHED: Dict[str, Callable] = {name: _resolve(name) for name in _PATCHES if name in UPSTREAM}
