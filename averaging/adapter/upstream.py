"""What the adapter relies on in hivemind, fingerprinted, so that an upgrade fails loudly instead of silently.

hivemind is pinned (PINNED_VERSION). UPSTREAM lists every upstream function that we copy, patch, override or
drive from outside, with a fingerprint of its source and the module of ours that depends on it. After an
upgrade, `changed_upstream()` names each one to re-read, and `install()` (averaging/adapter/install.py)
refuses to run on another version whose fingerprinted code changed.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
from typing import Callable, Dict, Iterable, List, Tuple

PINNED_VERSION = "1.1.12"

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
    # copied and patched by the adapter
    f"{_QUANTIZATION}.Quantization.extract": ("c522c9b6fd9ddaa2", "averaging/adapter/numpy2.py"),
    f"{_QUANTIZATION}.BlockwiseQuantization.extract": ("83c934773cc388e2", "averaging/adapter/numpy2.py"),
    f"{_AVERAGER}._declare_for_download_periodically": ("23ae6db0d205bcaf", "averaging/adapter/pacing.py"),
    "hivemind.averaging.key_manager.GroupKeyManager.get_averagers":
        ("916b0cdb1efbc75c", "averaging/adapter/pacing.py"),
    f"{_AVERAGER}.step": ("0bccfba139de5ec2",
                          "averaging/adapter/recorded_steps.py, averaging/pipeline/stragglers.py (its bandwidth)"),
    f"{_AVERAGER}._run_allreduce_inplace_": ("914d57cffc7d69e1", "averaging/adapter/allreduce.py"),
    f"{_AVERAGER}.run": ("56590878daa9e5a0", "averaging/adapter/allreduce.py"),
    f"{_AVERAGER}.run_in_background": ("028dd8b1e9b723d8", "averaging/adapter/allreduce.py"),
    f"{_AVERAGER}.rpc_join_group": ("a0c1dec1f5165713", "averaging/adapter/refusals.py"),
    f"{_AVERAGER}.rpc_download_state": ("fd2f6f19e7d247af",
                                        "averaging/adapter/refusals.py, averaging/adapter/state_averager.py"),
    f"{_AVERAGER}._load_state_from_peers": ("fe7b419d01ced5fe", "averaging/adapter/refusals.py"),
    f"{_MATCHMAKING}._request_join_group": ("df823040a94d1c1d", "averaging/adapter/refusals.py"),
    f"{_MATCHMAKING}.looking_for_group": ("a7f0ac4565e90cc9", "averaging/adapter/epoch_keys.py"),
    "hivemind.averaging.key_manager.GroupKeyManager.current_key":
        ("1b0f9d71104a01b3", "averaging/adapter/epoch_keys.py"),
    # a grouped round's target group size and window, set for it by averaging/adapter/epoch_keys.py: where they are read
    f"{_MATCHMAKING}.rpc_join_group": ("0d6120e412849439", "averaging/adapter/epoch_keys.py"),
    f"{_MATCHMAKING}._check_reasons_to_reject": ("c694e8194862154f", "averaging/adapter/epoch_keys.py"),
    "hivemind.averaging.matchmaking.PotentialLeaders._declare_averager_periodically":
        ("36280203c3a0aca0", "averaging/adapter/epoch_keys.py"),
    "hivemind.averaging.matchmaking.PotentialLeaders._update_queue_periodically":
        ("13036c7d743da89e", "averaging/adapter/epoch_keys.py"),
    "hivemind.averaging.control.StepControl.deadline":
        ("63918b9d81398e9a", "averaging/adapter/epoch_keys.py (it sets _deadline)"),
    f"{_AVERAGER}._step": ("dfbb4416e9ebba51", "averaging/adapter/epoch_keys.py (a round's deadline ends its retries)"),
    f"{_AVERAGER}.rpc_aggregate_part": ("06ad9597d5884df8", "averaging/adapter/grace.py"),
    "hivemind.averaging.averager.load_balance_peers": ("32f8b8d0c41d2653", "averaging/adapter/grace.py"),
    "hivemind.optim.power_sgd_averager.load_balance_peers": ("32f8b8d0c41d2653", "averaging/adapter/grace.py"),
    f"{_AVERAGER}._aggregate_with_group": ("c297d8a435ce2b1c", "averaging/adapter/grace.py (the bandwidths)"),
    "hivemind.optim.power_sgd_averager.PowerSGDGradientAverager._aggregate_with_group":
        ("b11c1e2073f5886f", "averaging/adapter/grace.py (the bandwidths it gathers)"),
    # subclassed by averaging/adapter/grace.py (and so by averaging/adapter/reducer.py)
    f"{_REDUCER}.__init__": ("9ebe1038f511931b", "averaging/adapter/grace.py"),
    f"{_REDUCER}.accumulate_part": ("1d64a8bd77052ac4", "averaging/adapter/grace.py"),
    f"{_REDUCER}.check_current_part_finished": ("ec9b059c42f3ca27", "averaging/adapter/grace.py"),
    f"{_REDUCER}.reset_accumulators": ("5d3dc36f344a342e", "averaging/adapter/grace.py"),
    f"{_REDUCER}.on_sender_failed": ("8a7de53789ffecb1", "averaging/adapter/grace.py"),
    f"{_REDUCER}.finalize": ("dded462a11871d59", "averaging/adapter/grace.py, averaging/adapter/reducer.py"),
    "hivemind.averaging.allreduce.AllReduceRunner.__init__":
        ("597a0c8dbbeabbe3", "averaging/adapter/runner.py"),
    # subclassed by averaging/adapter/runner.py
    "hivemind.averaging.allreduce.AllReduceRunner._accumulate_parts_streaming":
        ("6c5a3c7266060303", "averaging/adapter/runner.py"),
    "hivemind.averaging.allreduce.AllReduceRunner._communicate_with_peer":
        ("d910885e9727ed48", "averaging/adapter/runner.py"),
    "hivemind.averaging.allreduce.AllReduceRunner._check_reasons_to_reject":
        ("ac23a0fc97603637", "averaging/adapter/runner.py"),
    "hivemind.averaging.allreduce.AllReduceRunner.rpc_aggregate_part":
        ("c66765f4ad58eeaf", "averaging/adapter/grace.py, averaging/adapter/runner.py"),
    # subclassed by averaging/adapter/partition.py
    f"{_CONTAINER}.__init__": ("b652a9b7267354d8", "averaging/adapter/partition.py"),
    f"{_CONTAINER}.register_processed_part": ("ff5ebad6141c4a88", "averaging/adapter/partition.py"),
    f"{_CONTAINER}.register_failed_reducer": ("89b41b9d7f225968", "averaging/adapter/partition.py"),
    f"{_CONTAINER}.iterate_input_parts_for": ("e7a44eb8df9f9f26", "averaging/adapter/partition.py"),
    # overridden by HookedOptimizer and SyncOptimizer, or mimicked by DiLoCoOptimizer
    f"{_OPTIMIZER}.__init__": ("310edba41646edad", "averaging/adapter/optimizer.py, averaging/strategies/sync.py"),
    f"{_OPTIMIZER}._make_state_averager": ("59a43eff001c3284", "averaging/adapter/optimizer.py"),
    f"{_OPTIMIZER}._make_gradient_averager": ("b9a4450197c1e6fb", "dht/keys.py, averaging/adapter/optimizer.py"),
    f"{_OPTIMIZER}._make_progress_tracker": ("a3fe70a367d732d6", "dht/keys.py"),
    f"{_OPTIMIZER}._update_global_epoch": ("03a36523a3fce65e", "averaging/adapter/optimizer.py"),
    f"{_OPTIMIZER}._check_and_accumulate_gradients": ("163c06c8f4909c30", "averaging/adapter/optimizer.py"),
    f"{_OPTIMIZER}._begin_averaging_gradients": ("f17d8bb258a0c551", "averaging/adapter/optimizer.py"),
    f"{_OPTIMIZER}._average_gradients_and_load_into_optimizer": ("d95bb5ebc061749e", "averaging/adapter/optimizer.py"),
    f"{_OPTIMIZER}._should_load_state_from_peers": ("e1af5bdfc8e60b70",
                                                    "averaging/adapter/optimizer.py, averaging/strategies/diloco.py"),
    f"{_OPTIMIZER}.load_state_from_peers": ("87030a961ecf8f7f", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}.shutdown": ("52e41b26128082bc", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}.state_dict": ("55bd9a9e33fa57c6", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}.load_state_dict": ("f27b8effe1d8a2d1", "averaging/strategies/sync.py"),
    f"{_OPTIMIZER}._tag_along_with_zero_weight": ("a3181486ff4e2ac7", "averaging/adapter/optimizer.py"),
    f"{_OPTIMIZER}._load_averaged_gradients_into_optimizer_":
        ("cdf2fbb98f778b8d", "averaging/adapter/optimizer.py"),
    f"{_OPTIMIZER}._load_local_gradients_into_optimizer": ("a87c64b6e88bf642", "averaging/adapter/optimizer.py"),
    # overridden by the guarded state averagers (and called with _make_state_averager's arguments)
    f"{_STATE_AVERAGER}.__init__": ("97f573400a46cdf9", "averaging/adapter/state_averager.py"),
    f"{_STATE_AVERAGER}._apply_averaging_results_": ("32b49f6bd7088974", "averaging/adapter/state_averager.py"),
    f"{_STATE_AVERAGER}.load_state_from_peers": ("e4d647a9ea78cde8", "averaging/adapter/state_averager.py"),
    f"{_STATE_AVERAGER}._do": ("0b1896170cc6bdb0", "averaging/adapter/state_averager.py"),
    f"{_STATE_AVERAGER}.step": ("c68d9335d0ccf55e", "averaging/adapter/state_averager.py"),
    f"{_STATE_AVERAGER}.schedule_step": ("0bfdb7a54a74e4ee", "averaging/adapter/state_averager.py"),
    f"{_STATE_AVERAGER}.get_current_state": ("d2ee431a0a4b4074", "averaging/adapter/state_averager.py"),
    f"{_AVERAGER}.load_state_from_peers": ("973fae40a3d1e16f", "averaging/adapter/state_averager.py"),
    f"{_AVERAGER}.shutdown": ("0e5ce71e3b8ac3cc", "averaging/adapter/state_averager.py"),
    # the event loops of the averager's and the DHT's processes: made where these call it, patched where they look it up
    "hivemind.averaging.averager.switch_to_uvloop": ("04777b279a3d7fc8", "averaging/adapter/kept_tasks.py"),
    "hivemind.dht.dht.switch_to_uvloop": ("04777b279a3d7fc8", "averaging/adapter/kept_tasks.py"),
    f"{_AVERAGER}._run_internal": ("8f85686e1ccd3eb0", "averaging/adapter/kept_tasks.py"),
    # dht/node.py gives a DHT that has not started its own validator (dht/verdicts.py): run and add_validators use it
    "hivemind.dht.dht.DHT.run": ("bd3a376f042d386e", "dht/node.py, averaging/adapter/kept_tasks.py"),
    "hivemind.dht.dht.DHT.add_validators": ("fecf1863c55f0fd4", "dht/node.py"),
    f"{_TRACKER}._parse_swarm_progress_data": ("1b5ad87469d3c13f", "averaging/adapter/progress_filter.py"),
    f"{_TRACKER}.report_local_progress": ("9bf530c8bc98f445", "averaging/adapter/pacing.py"),
    # read or driven from outside
    f"{_STATE_AVERAGER}._init_components": ("a60b74a78a5c5503",
                                            "averaging/adapter/fresh_optimizer.py (it skips state that exists)"),
    f"{_TRACKER}._progress_reporter": ("affc9ed95108eacf",
                                       "averaging/swarm/progress.py, averaging/adapter/late_stores.py"),
    f"{_TRACKER}._progress_fetcher": ("ed458942519098a2", "averaging/swarm/progress.py"),
    "hivemind.optim.power_sgd_averager.PowerSGDGradientAverager.__init__":
        ("cabf7da27882b293", "averaging/codecs/compression.py"),
    "hivemind.compression.serialization.deserialize_torch_tensor": ("74f1eed9fb9b7de3",
                                                                     "averaging/adapter/codec_registry.py"),
    # the process-wide locks a forked peer makes anew (all three of them, and who takes them)
    "hivemind.utils.mpfuture.MPFuture.reset_backend": ("06cd5e31b99b4f58", "averaging/adapter/process_locks.py"),
    "hivemind.utils.asyncio._AsyncContextWrapper.get_process_wide_executor":
        ("8776276b21fb8d8a", "averaging/adapter/process_locks.py"),
}


class HivemindIncompatible(RuntimeError):
    """Another hivemind version whose code we copy or override has changed."""


_originals: Dict[str, Callable] = {}  # upstream's functions as they were before the adapter patched them


def remember_originals(names: Iterable[str]) -> None:
    """Before patching: keep upstream's functions, so that they can still be fingerprinted once patched."""
    for name in names:
        if name in UPSTREAM and name not in _originals:
            _originals[name] = resolve(name)


def fingerprint(qualified_name: str) -> str:
    original = _originals.get(qualified_name) or resolve(qualified_name)
    if isinstance(original, property):
        original = original.fget
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


def resolve(qualified_name: str):
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
