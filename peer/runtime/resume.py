"""What a peer's checkpoint holds, and resuming from one.

The model's weights are restored before the optimizer is built (hivemind copies them into its
averagers); the optimizer's state, the LR scheduler and the counters after. A checkpoint from
another run or task is refused, since mixing them would silently train the wrong model.
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional

import torch

from averaging.api import LoopOptimizer
from peer.checkpoint.store import CheckpointStore, LoadedCheckpoint
from peer.config import PeerConfig
from peer.exit_codes import BadInput
from peer.runtime.precision import MixedPrecision
from peer.tasks.base import Task
from peer.tasks.order import DataPosition
from peer.telemetry.summary import PeerSummary

logger = logging.getLogger(__name__)


def training_state(config: PeerConfig, task: Task, model: torch.nn.Module, optimizer: LoopOptimizer,
                   summary: PeerSummary, precision: MixedPrecision, data_position: DataPosition) -> dict:
    """Everything a checkpoint holds (the optimizer's background updates must have landed)."""
    scheduler = optimizer.scheduler
    return {
        "grad_scaler": precision.state_dict(),  # empty unless fp16: then the loss scale it has found
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "local_epoch": optimizer.local_epoch,
        "local_steps": summary.local_steps,
        "samples": summary.samples,
        "data": data_position.state_dict(),  # the order this peer reads its data in, and how far it has read
        "run_id": config.training.run_id,
        "task": task.name,
        "task_spec": config.training.task,  # the --task `peer export` rebuilds (a module:function's name differs)
        "swarm_hash": config.swarm_hash(),
        # what `peer export` rebuilds the task from: load_task(task, options=TaskOptions(**task_options))
        "task_options": config.task.model_dump(mode="json"),
        # and what those options' files held then (hf-causal-lm's configuration): export refuses files changed since
        "task_digests": dict(task.shared_digests),
    }


def changed_task_files(state: dict, shared_digests: Mapping[str, str]) -> str:
    """What the files the task's options name (hf-causal-lm's configuration, tokenizer) held when the checkpoint
    was written, where it differs from now: '' when nothing does. The starting weights (--init-from) are left
    out: the checkpoint's weights replace them. A checkpoint of before they were recorded holds none."""
    recorded = {option: digest for option, digest in (state.get("task_digests") or {}).items()
                if option != "init_from"}
    return ", ".join(f"{option} (digest {digest} then, {shared_digests.get(option)} now)"
                     for option, digest in sorted(recorded.items()) if shared_digests.get(option) != digest)


def restore_model(store: CheckpointStore, config: PeerConfig, task_name: str, model: torch.nn.Module,
                  shared_digests: Mapping[str, str] = {}) -> Optional[LoadedCheckpoint]:
    """Load the newest readable checkpoint's weights into model; the checkpoint, or None if there is none.

    :param shared_digests: the task's (Task.shared_digests): a checkpoint trained with other files is refused"""
    checkpoint = store.load_latest()
    if checkpoint is None:
        return None
    state = checkpoint.state
    if state.get("run_id") != config.training.run_id or state.get("task") != task_name:
        raise RuntimeError(
            f"checkpoint {checkpoint.path} belongs to run {state.get('run_id')!r} "
            f"(task {state.get('task')!r}), not run {config.training.run_id!r} (task {task_name!r}); "
            f"use another --checkpoint-dir"
        )
    changed = changed_task_files(state, shared_digests)
    if changed:  # the same layout, another model (a configuration's rotary base): it would train on silently
        raise BadInput(f"--checkpoint-dir {config.checkpoint.checkpoint_dir}: {checkpoint.path.name} was trained "
                       f"with other files than the task's options name now: {changed}; start with the files it "
                       f"was written with (task_options in it names them), or use another --checkpoint-dir")
    if state.get("swarm_hash") != config.swarm_hash():
        logger.warning(f"{checkpoint.path} was written with different swarm settings; resuming anyway")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:  # torch lists every mismatched tensor, over many lines: name the first
        details = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        first = details[0].split(". ")[0] if details else str(e).splitlines()[0]
        raise BadInput(f"--checkpoint-dir {config.checkpoint.checkpoint_dir}: {checkpoint.path.name} holds weights "
                       f"of another model than --task {task_name} builds with these options ({first}); start with "
                       f"the options it was written with (--model-config...), or use another --checkpoint-dir") from e
    return checkpoint


def restore_optimizer(checkpoint: Optional[LoadedCheckpoint], optimizer: LoopOptimizer, summary: PeerSummary,
                      precision: Optional[MixedPrecision] = None) -> None:
    """The optimizer's state, the LR scheduler, the loss scale and the peer's counters, from the checkpoint
    restore_model read."""
    if checkpoint is None:
        return
    state = checkpoint.state
    optimizer.load_state_dict(state["optimizer"])
    if precision is not None:
        precision.load_state_dict(state.get("grad_scaler") or {})
    scheduler = optimizer.scheduler
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    summary.local_steps, summary.samples = state.get("local_steps", 0), state.get("samples", 0)
    summary.resumed_from = str(checkpoint.path)
    logger.info(f"resumed from {checkpoint.path} at epoch {optimizer.local_epoch}")
