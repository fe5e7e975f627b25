"""`peer export`'s work: the model of a checkpoint, rebuilt as its peer built it, written where other tools load it.

The task that wrote the checkpoint is rebuilt from what the checkpoint records (its name and options), its
model seeded from the run id and built as a peer builds it, and the checkpoint's weights loaded into it, so that
the task's own exporter gets the model object it knows. Without one, the model's state_dict is written as
model.safetensors (every name present, a tied tensor copied under each of its names) with model.json describing
it. The output is built in a temporary directory beside its final place, synced, and renamed into place, so a
failed export leaves nothing half-written.

This module must not read the peer's config, take the checkpoint directory's lock or touch the network: it
reads a checkpoint another process may still be writing beside, and writes one directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pydantic
import torch
from safetensors import SafetensorError
from safetensors.torch import save as save_safetensors

from peer.checkpoint.files import describe, fsync_directory, remove_quietly, write_synced
from peer.checkpoint.store import LoadedCheckpoint
from peer.checkpoint.weights import SAFETENSORS_METADATA, tied_names, with_every_name
from peer.exit_codes import BadInput
from peer.runtime.resume import changed_task_files
from peer.runtime.trainer import seed_from_run_id
from peer.tasks import Task, TaskLoadError, load_task
from peer.tasks.contract import call_task
from peer.tasks.options import TaskOptions
from peer.version import __version__

MODEL_FILE = "model.safetensors"
DESCRIPTION_FILE = "model.json"
DESCRIPTION_FORMAT = "swarmtrain-export"


class ExportFailed(RuntimeError):
    """Writing the output failed (a full disk, a task's exporter that raised); the message is one line."""


def rebuild_model(checkpoint: LoadedCheckpoint, task_timeout_seconds: float) -> Tuple[Task, torch.nn.Module]:
    """The task that wrote `checkpoint` and its model, holding the checkpoint's weights, on the CPU.

    :raises BadInput: the checkpoint records no task, or its task cannot be built here, or its weights do not fit
    """
    state, name = checkpoint.state, checkpoint.path.name
    task_name = task_spec(state)
    if not isinstance(task_name, str) or not isinstance(state.get("model"), dict):
        raise BadInput(f"--checkpoint-dir: checkpoint {name} records no task and model weights, so it was not "
                       f"written by peer start; name a directory that peer start wrote checkpoints to")
    try:
        options = TaskOptions(**(state.get("task_options") or {}))
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "the options"
        raise BadInput(f"--checkpoint-dir: checkpoint {name} records task options this swarmtrain {__version__} "
                       f"does not take ({field}: {error['msg']}); export it with the version that wrote it") from e
    where = f"task {task_name} of checkpoint {name}"
    try:
        task = load_task(task_name, task_timeout_seconds, options)
        torch.manual_seed(seed_from_run_id(str(state.get("run_id", ""))))  # as every peer of the run built it
        model = call_task(where, "build_model()", task.build_model)
    except TaskLoadError as e:  # TaskContractError too: build_model() raised
        raise BadInput(f"--checkpoint-dir: the {where} cannot be built here: {e}") from e
    changed = changed_task_files(state, task.shared_digests)
    if changed:
        raise BadInput(f"--checkpoint-dir: the files the {where} names changed since it was written: {changed}; "
                       f"the export would describe another model than the one trained: restore them "
                       f"(task_options in the checkpoint names them)")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise BadInput(f"--checkpoint-dir: the weights of checkpoint {name} do not fit the model {task_name} "
                       f"builds here ({' '.join(str(e).split())[:300]}); export with the task code that wrote "
                       f"it") from e
    return task, model.cpu().eval()


def task_spec(state: dict) -> object:
    """The --task that built a checkpoint's model. Checkpoints written before it was recorded hold only the task's
    own name, which is the --task of a built-in."""
    return state.get("task_spec") or state.get("task")


def export_into(out: Path, replace: bool, task: Task, model: torch.nn.Module,
                checkpoint: LoadedCheckpoint) -> List[str]:
    """Write the model into `out` (absent, empty, or replaced when `replace`); the names written there.

    :raises ExportFailed: nothing was written to `out` (an existing `out` is left as it was)
    """
    temp = out.parent / f".{out.name}.export-{secrets.token_hex(4)}.tmp"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(temp)
        if task.export_model is not None:
            call_task(f"task {task.name}", "export_model(model, directory)", task.export_model, model, temp)
        else:
            write_safetensors_export(temp, model, checkpoint, task)
        _sync_tree(temp)
        _install(temp, out, replace)
    except (OSError, TaskLoadError, SafetensorError) as e:  # a full disk; a task's exporter; weights it cannot hold
        remove_quietly(temp)
        raise ExportFailed(f"cannot write --out {out}: {describe(e)}; nothing was written there") from e
    except BaseException:
        remove_quietly(temp)
        raise
    return sorted(os.listdir(out))


def write_safetensors_export(directory: Path, model: torch.nn.Module, checkpoint: LoadedCheckpoint,
                             task: Task) -> None:
    """model.safetensors (the model's state_dict, every name present) and model.json describing it."""
    state = checkpoint.state
    weights = model.state_dict()
    metadata = {**SAFETENSORS_METADATA, "swarmtrain_task": str(task_spec(state)),
                "swarmtrain_run_id": str(state.get("run_id")), "swarmtrain_global_epoch": str(checkpoint.global_epoch)}
    data = save_safetensors(with_every_name(weights), metadata=metadata)
    named = {name for name, _ in model.named_parameters(remove_duplicate=False)}  # a tied one under each name
    description = {
        "format": DESCRIPTION_FORMAT,
        "version": 1,
        "swarmtrain_version": __version__,
        "task": task_spec(state),  # what rebuilds it: peer start --task, load_task()
        "task_name": task.name,
        "task_options": state.get("task_options") or {},
        "run_id": state.get("run_id"),
        "global_epoch": checkpoint.global_epoch,
        "checkpoint": {"path": str(checkpoint.path.absolute()), "sha256": checkpoint.sha256},
        "weights": {"file": MODEL_FILE, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
        "parameter_count": sum(parameter.numel() for parameter in model.parameters()),  # each tied one once
        "tensors": {name: _tensor_entry(tensor, name in named) for name, tensor in weights.items()},
        "tied": tied_names(weights),
    }
    write_synced(directory / MODEL_FILE, data)
    write_synced(directory / DESCRIPTION_FILE, (json.dumps(description, indent=1) + "\n").encode())


def _tensor_entry(tensor: torch.Tensor, is_parameter: bool) -> Dict[str, object]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "kind": "parameter" if is_parameter else "buffer"}


def _sync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (a task's exporter writes with no fsync of its own)."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(Path(directory))


def _install(temp: Path, out: Path, replace: bool) -> None:
    """Rename `temp` to `out`. An existing `out` (only ever empty, or `replace`) is moved aside first and deleted
    once the new one is in place, or moved back if that fails."""
    aside: Optional[Path] = None
    if out.is_dir() and any(out.iterdir()):
        if not replace:  # checked before the export began; something wrote there since
            raise FileExistsError(f"{out} is no longer empty")
        aside = out.parent / f".{out.name}.replaced-{secrets.token_hex(4)}.tmp"
        os.rename(out, aside)
    try:
        os.replace(temp, out)  # over an empty directory, or into a free name
    except OSError:
        if aside is not None:
            os.rename(aside, out)
        raise
    fsync_directory(out.parent)
    if aside is not None:
        remove_quietly(aside)
