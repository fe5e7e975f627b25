"""The hivemind adapter (averaging/adapter/): one install() for every patch, and an upgrade of hivemind that
changes code we copy or override fails with the list of places to re-read."""
from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace

import hivemind
import pytest
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from hivemind.compression.quantization import Quantization
from hivemind.optim.optimizer import Optimizer
from hivemind.optim.state_averager import TrainingStateAverager

from averaging import adapter
from averaging.adapter import numpy2, pacing, recorded_steps
from averaging.adapter.optimizer import HookedOptimizer
from averaging.adapter.partition import FeedbackPartContainer
from averaging.adapter.reducer import RobustAllReduceRunner, RobustPartReducer
from averaging.adapter.runner import CanonicalAllReduceRunner
from averaging.adapter.state_averager import GuardedStateAverager, ReportingStateAverager
from averaging.strategies.diloco import DiLoCoOptimizer
from averaging.strategies.sync import SyncOptimizer


def test_the_installed_hivemind_matches_every_fingerprint():
    assert hivemind.__version__ == adapter.PINNED_VERSION
    assert adapter.changed_upstream() == []


def test_a_changed_upstream_function_is_named_with_the_module_that_depends_on_it(monkeypatch):
    def _begin_averaging_gradients(self, grad_scaler):  # what an upgrade might ship instead
        return False

    monkeypatch.setattr(Optimizer, "_begin_averaging_gradients", _begin_averaging_gradients)
    assert adapter.changed_upstream() == [
        "hivemind.optim.optimizer.Optimizer._begin_averaging_gradients (used by averaging/adapter/optimizer.py)"
    ]


def test_a_removed_upstream_function_is_named_too(monkeypatch):
    monkeypatch.delattr(TrainingStateAverager, "_apply_averaging_results_")
    changed = adapter.changed_upstream()
    assert changed == ["hivemind.optim.state_averager.TrainingStateAverager._apply_averaging_results_ "
                       "(used by averaging/adapter/state_averager.py)"]


def test_install_refuses_another_version_whose_code_we_rely_on_changed(monkeypatch):
    monkeypatch.setattr(hivemind, "__version__", "9.9.9")
    monkeypatch.setattr(Optimizer, "_begin_averaging_gradients", lambda self, grad_scaler: False)
    with pytest.raises(adapter.HivemindIncompatible) as error:
        adapter.install()
    message = str(error.value)
    assert "hivemind 9.9.9" in message and "Optimizer._begin_averaging_gradients" in message
    assert "pip install hivemind==1.1.12" in message


def test_install_on_another_version_with_unchanged_code_warns_and_patches(monkeypatch, caplog):
    monkeypatch.setattr(hivemind, "__version__", "1.1.13")
    monkeypatch.setattr(GroupKeyManager, "get_averagers", pacing.unpaced_get_averagers)
    with caplog.at_level(logging.WARNING):
        adapter.install()
    assert "hivemind 1.1.13 (expected 1.1.12)" in caplog.text
    assert GroupKeyManager.get_averagers is pacing.paced_get_averagers


def test_install_puts_every_patch_in_place_and_twice_is_the_same_as_once():
    adapter.install()
    adapter.install()
    assert Quantization.extract is numpy2.quantization_extract
    assert GroupKeyManager.get_averagers is pacing.paced_get_averagers
    assert DecentralizedAverager._declare_for_download_periodically is (
        pacing.paced_declare_for_download_periodically)
    assert DecentralizedAverager.step is recorded_steps.recorded_step
    # patched or not, the fingerprints are those of upstream's originals
    assert adapter.changed_upstream() == []


@pytest.mark.parametrize("ours, upstream", [
    (SyncOptimizer, Optimizer),
    (GuardedStateAverager, TrainingStateAverager),
    (ReportingStateAverager, TrainingStateAverager),
    (FeedbackPartContainer, TensorPartContainer),
    (RobustPartReducer, TensorPartReducer),
    (RobustAllReduceRunner, AllReduceRunner),
    (CanonicalAllReduceRunner, AllReduceRunner),
])
def test_every_upstream_method_our_subclasses_override_is_fingerprinted(ours, upstream):
    for cls in ours.__mro__:
        if cls.__module__.startswith("hivemind"):
            break
        for name, member in vars(cls).items():
            if not callable(member) or name in ("__module__", "__doc__"):
                continue
            for base in upstream.__mro__:
                if name in vars(base) and base.__module__.startswith("hivemind"):
                    qualified = f"{base.__module__}.{base.__qualname__}.{name}"
                    assert qualified in adapter.UPSTREAM, f"{cls.__name__}.{name} overrides {qualified}"
                    break


def test_diloco_mimics_upstreams_resync_rule_which_is_fingerprinted():
    assert "_should_load_state_from_peers" in vars(DiLoCoOptimizer)
    assert "hivemind.optim.optimizer.Optimizer._should_load_state_from_peers" in adapter.UPSTREAM
    assert inspect.getsource(Optimizer._should_load_state_from_peers)



class _Control:
    """What upstream reads of a hivemind StepControl here (a real one needs the averager's process to attach to)."""

    def __init__(self, done: bool = False):
        self.triggered, self._done = False, done

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        self._done = True


class _GradientAverager:
    def __init__(self):
        self.steps = []

    def step(self, control=None, reset_accumulators=False, wait=True):
        self.steps.append(control)
        return _Control()


def test_a_round_scheduled_ahead_that_already_failed_is_replaced_by_a_fresh_one_not_skipped():
    """Upstream steps on local gradients alone when the round it scheduled ahead ended before the epoch (on a loaded
    machine its deadline passes while the peer runs late): one peer apart from its group, every time it happens."""
    optimizer = object.__new__(HookedOptimizer)  # the method under test reads only these attributes
    skipped = []
    optimizer.round_skipped = lambda: skipped.append(True)
    optimizer.scheduled_grads, optimizer.grad_averager = _Control(done=True), _GradientAverager()
    optimizer.tracker = SimpleNamespace(global_progress=SimpleNamespace(num_peers=2))
    optimizer.status_loglevel, optimizer._parent_pid = logging.DEBUG, None  # upstream's __del__ reads the latter

    assert optimizer._begin_averaging_gradients(grad_scaler=None) is True
    assert optimizer.grad_averager.steps == [None]  # a fresh round, not the failed control
    assert not optimizer.scheduled_grads.done() and skipped == []

    optimizer.tracker.global_progress.num_peers = 1  # alone, it still skips as upstream does
    optimizer.scheduled_grads = _Control(done=True)
    assert optimizer._begin_averaging_gradients(grad_scaler=None) is False
    assert skipped == [True] and optimizer.scheduled_grads is None and len(optimizer.grad_averager.steps) == 1
